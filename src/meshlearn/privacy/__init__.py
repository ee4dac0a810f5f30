"""Privacy of the data members train on: secure aggregation (``secagg``) and differential privacy (``dp``)."""
