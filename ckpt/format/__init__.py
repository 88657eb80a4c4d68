"""The logical checkpoint format, the records a checkpoint holds and the restricted readers of its files."""
