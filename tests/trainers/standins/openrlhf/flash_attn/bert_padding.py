"""Stand-in (see the package's docstring): names openrlhf.models.ring_attn_utils imports; calling one raises."""

from typing import Any, NoReturn


def _gpu_only(*args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError("flash_attn is a test stand-in here: the reward path never calls it")


index_first_axis = pad_input = rearrange = unpad_input = _gpu_only
