"""The pure core: models, fitting, the batch split, the policies (goodput, baselines, Sia, typed choice), the scheduling pass."""
