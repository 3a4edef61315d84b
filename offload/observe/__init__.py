"""Instruments that watch a step without changing it: phase times and bytes per link (telemetry), every
host-blocking wait by the thread that waited (the sync ledger), and the step recorded as a graph (the step graph)."""
