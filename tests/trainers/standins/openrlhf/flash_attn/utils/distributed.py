"""Stand-in (see flash_attn's docstring): all_gather, imported by openrlhf.models.ring_attn_utils; it raises."""

from flash_attn.bert_padding import _gpu_only

all_gather = _gpu_only
