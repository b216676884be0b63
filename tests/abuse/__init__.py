"""A hostile lab member against a real root daemon (root only: the tests make Unix users)."""
