"""The three verifier kinds, plugin, endpoint and rubric, each a package of one shape."""
