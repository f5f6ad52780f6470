from .config import EngineConfig
from .engine import Engine, QueueFullError
from .stats import EngineStats

__all__ = ["Engine", "EngineConfig", "EngineStats", "QueueFullError"]
