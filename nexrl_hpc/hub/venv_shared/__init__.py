"""Standard-library code the hubs' venv workers share (put on their ``sys.path`` by each worker)."""
