"""The final assistant text of a trajectory: a string, one message, or a list of messages."""


def answer_text(trajectory):
    if isinstance(trajectory, str):
        return trajectory
    if isinstance(trajectory, dict):
        return answer_text(trajectory.get("content") or "")
    if isinstance(trajectory, list):
        assistant = [m for m in trajectory if isinstance(m, dict) and m.get("role") == "assistant"]
        return answer_text(assistant[-1]) if assistant else ""
    raise TypeError(f"unsupported trajectory type {type(trajectory).__name__}")
