"""Each mode as a per-request state machine stepped by the engine core (see base.py)."""
