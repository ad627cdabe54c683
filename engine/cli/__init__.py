"""The `kvpilot` command line."""
