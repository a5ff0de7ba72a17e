import os
import time

with open(os.environ["ENGINE_TEST_IMPORT_LOG"], "a") as log:
    log.write("imported\n")
time.sleep(0.2)  # a slow import widens the window in which concurrent first calls could race


def score(task, trajectory):
    return 1.0
