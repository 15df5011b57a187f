"""bluecached/tiers."""
