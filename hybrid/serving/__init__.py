"""Serving: the memory plan of the pools a server holds (`capacity`); the engine builds on it."""
