"""What may differ between a save and its load: optimizer kind and sharding, precision, vocab rows."""
