"""Model building blocks."""
