"""Search spaces shipped as package data: which knobs to search on each device, and their choices."""
