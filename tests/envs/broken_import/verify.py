import a_module_that_does_not_exist_anywhere  # noqa: F401


def score(task, trajectory):
    return 1.0
