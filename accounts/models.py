"""Models arrive with this app's issue."""
