"""What runs inside each replica container. Nothing here imports a cloud SDK."""
