"""Import-only stand-in: ``slime.backends.sglang_utils.arguments`` imports ``ServerArgs`` at its top for
``sglang_parse_args`` (SGLang's server options), which the suite never calls. See ../../README.md."""


class ServerArgs:
    """The name only: anything that uses it is a call the reward path never makes."""
