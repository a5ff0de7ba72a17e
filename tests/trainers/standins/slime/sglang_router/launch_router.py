"""Import-only stand-in: ``slime.backends.sglang_utils.arguments`` imports ``RouterArgs`` at its top for the
router's options in ``sglang_parse_args``, which the suite never calls. See ../README.md."""


class RouterArgs:
    """The name only: anything that uses it is a call the reward path never makes."""
