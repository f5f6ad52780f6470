"""The OpenAI-compatible server. ``build_app`` is imported lazily so the CLI starts without loading FastAPI."""


def __getattr__(name):
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(name)


__all__ = ["build_app"]
