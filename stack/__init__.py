"""stack: starts the whole kvoffload stack as local processes (the no-Docker path)."""
