"""The ``engine`` command behind ``engine.cli``: lifecycle (signals, exit codes), render (what it prints), commands."""
