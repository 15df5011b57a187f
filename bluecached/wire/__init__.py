"""bluecached/wire."""
