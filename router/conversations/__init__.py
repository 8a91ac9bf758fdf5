"""Conversations: turns, where their KV lives (registry, state), D's leases, history."""
