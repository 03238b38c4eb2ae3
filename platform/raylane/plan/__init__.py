"""Predictions for layouts before they run: memory per device now; step time to follow."""
