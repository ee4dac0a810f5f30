"""A requester: claims providers, plans and shares data, follows and grows a task, collects its results."""
