"""Stand-in (see vllm's docstring): random_uuid, the request id RolloutRayActor.generate passes vLLM."""

import uuid


def random_uuid() -> str:
    return uuid.uuid4().hex
