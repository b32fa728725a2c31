"""The OpenAI-compatible server (chapter 13): ``AsyncLLM``, the FastAPI app, Prometheus metrics, ``serve``.

``import minivllm`` does not load this package (a front end: it needs FastAPI,
uvicorn and prometheus-client). ``python -m minivllm serve`` runs it.
"""

from minivllm.serving.api import OpenAIServing
from minivllm.serving.app import build_app
from minivllm.serving.async_llm import AsyncLLM, QueueFull, RequestFailed, RequestStream, ServerShuttingDown
from minivllm.serving.engine_loop import EngineLoop, MiniEngineLoop
from minivllm.serving.metrics import ServerMetrics

__all__ = ["AsyncLLM", "EngineLoop", "MiniEngineLoop", "RequestStream", "QueueFull", "ServerShuttingDown",
           "RequestFailed", "OpenAIServing", "build_app", "ServerMetrics"]
