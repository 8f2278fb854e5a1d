"""User-facing errors: one line that names the fix; the CLI prints them without a traceback."""


class HelixError(Exception):
    """A mistake in the user's input (model, layout, request, YAML). Message names the fix."""


class ConfigError(HelixError):
    """Invalid model config, layout or runtime settings."""


class CheckpointError(HelixError):
    """A checkpoint that cannot be loaded: missing path, unsupported architecture, bad tensor."""


class RequestError(HelixError):
    """A request that cannot be served: bad token ids, too long, empty prompt."""


class CapacityError(HelixError):
    """The KV pool cannot hold a request; the other requests are untouched."""


class EngineDeadError(HelixError):
    """The engine stopped working (a rank died, or a failure it could not confine); it refuses
    further work. The message says why; restart the LLM."""
