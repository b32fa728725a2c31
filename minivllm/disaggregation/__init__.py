"""Prefill/decode disaggregation: a front, a prefill worker and a decode worker, the KV link (chapter 16).

Importing this package starts nothing: processes exist only while a
:class:`DisaggregatedEngine` (``LLM(..., disaggregated=True)``) runs.
"""

from minivllm.disaggregation.front import ROLES, DisaggregatedEngine
from minivllm.disaggregation.link import LinkError

__all__ = ["DisaggregatedEngine", "LinkError", "ROLES"]
