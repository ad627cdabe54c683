"""The `kvpilot` command line: ``serve``, ``generate``, ``plan``, ``operator``, ``bench``.

May import anything (each subcommand imports its side lazily, so ``kvpilot operator``
never loads torch); nothing below the command line imports it but the server's parser.
"""
