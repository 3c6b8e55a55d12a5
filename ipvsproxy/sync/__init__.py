"""The pure sync core: desired state, ownership, planning, plan rendering."""
