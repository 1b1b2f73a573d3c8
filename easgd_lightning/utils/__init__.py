"""Small utilities (atomic writes)."""
