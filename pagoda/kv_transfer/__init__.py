"""Moving KV blocks between tiers (device <-> host); one interface, bulk copies per layer."""
