"""A runnable, quick configuration of every built-in pass (``tests/test_pass_contract.py``,
``tests/test_every_pass_on_two_ranks.py``)."""

# A new pass must add one (test_pass_contract.py::test_every_pass_has_a_sample fails).
SAMPLES = {
    "identity": {},
    "analyze": {},
    "protect_super_experts": {"percentile": 90.0},
    "ablate_experts": {"experts": [{"layer": 0, "experts": [2]}]},
    "heapr": {"ratio": 0.25},
    "neuron_prune": {"ratio": 0.25, "layout": "uniform"},
    "expert_prune": {"ratio": 0.25},
    "tdmoe": {"ratio": 0.4},
    "svd_experts": {"ratio": 0.4},
    "expert_structure": {"ratios": [0.4]},
    "decompose": {"method": "auto", "ratio": 0.4},
    "choose_groups": {},
    "attribute_routing": {"protect": 2},
    "router_robustness": {"epsilons": [0.0, 0.1], "steps": 3},
    "codequant": {"bits": 3, "rotation_steps": 3, "kmeans_iters": 10, "finetune_steps": 2},
    "rtn": {"bits": 4},
    "gptq": {"bits": 3, "act_order": True},
    "namex": {"ratio": 0.25, "refine_steps": 2},
    "merge_experts": {"ratio": 0.25, "router": "collapse"},
    "capacity_drop": {"gamma": 1.0},
    "sere": {"select_top": 1, "threshold": 0.1},
    "routing_report": {"batch_sizes": [1, 4]},
}
