"""Errors a user can cause. They carry a message meant to be shown as it is, without a traceback."""


class KvferryError(Exception):
    """Base class: anything the CLI or an API prints as a one-line error."""


class InvalidRequest(KvferryError, ValueError):
    """A request that can never be served as given (bad sampling value, prompt too long, ...)."""


class ModelLoadError(KvferryError):
    """A model path or architecture kvferry cannot load."""


class ConfigError(KvferryError, ValueError):
    """Settings that cannot work together."""


class FatalError(KvferryError):
    """What ends a worker: a broken device, or settings that cannot work, found at startup. Nothing a single
    request does may raise it: the blocks that serve one request (common/request_failure.fails_alone) let only it
    through."""
