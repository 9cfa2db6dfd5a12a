"""Pipeline stages: plain typed functions over artifacts (profile -> fit -> validate)."""
