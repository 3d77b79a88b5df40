"""The node daemon and its drivers: membership, Raft, placement, admission."""
