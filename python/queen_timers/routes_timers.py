"""Routes: filled in by its issue."""

routes: list = []
