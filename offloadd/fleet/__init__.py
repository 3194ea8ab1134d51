"""Several nodes: which node's daemon holds which block (the fleet index, from their logs)."""
