def score(task, trajectory):
    return 0.75
