"""The ``stepvault`` command."""
