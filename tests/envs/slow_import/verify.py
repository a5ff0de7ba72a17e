import time

time.sleep(1.0)  # an import that outlasts a short call timeout


def score(task, trajectory):
    return 1.0
