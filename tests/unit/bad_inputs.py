"""Adversarial command lines a new user might type, as data (no tests here).

BAD: (input class, Hydra overrides, the dotted field the refusal must name). Each must be
refused at start-up (compose / validate / the constructors / check_environment, as train.py
runs them, before any engine or model is built) with a ``ConfigError`` or a Hydra composition
error whose message names that field, the value given and what is allowed. The field is the
key as the user typed it (for a cross-field rule: the field the error should name).

GOOD: valid but unusual command lines that must be accepted.
"""

from __future__ import annotations

BAD: list[tuple[str, list[str], str]] = [
    # --- wrong type: a value the field's annotation does not allow --------------------------
    ("wrong_type", ["rollout.group_size=eight"], "rollout.group_size"),
    ("wrong_type", ["rollout.prompts_per_step=[16]"], "rollout.prompts_per_step"),
    ("wrong_type", ["rollout.sampling.top_p=high"], "rollout.sampling.top_p"),
    ("wrong_type", ["algo.epochs=1.5"], "algo.epochs"),
    ("wrong_type", ["algo.loss.kl_coef=small"], "algo.loss.kl_coef"),
    ("wrong_type", ["engine.max_model_len=400.0"], "engine.max_model_len"),
    ("wrong_type", ["engine.replicas=two"], "engine.replicas"),
    ("wrong_type", ["data.train_size=1e4"], "data.train_size"),  # scientific notation is a float
    ("wrong_type", ["trainer.max_steps=1e3"], "trainer.max_steps"),
    ("wrong_type", ["trainer.devices=one"], "trainer.devices"),
    ("wrong_type", ["callbacks.weight_sync.lag=one"], "callbacks.weight_sync.lag"),
    ("wrong_type", ["module.gradient_checkpointing=maybe"], "module.gradient_checkpointing"),
    ("wrong_type", ["seed=abc"], "seed"),
    ("wrong_type", ["recipe=lora_grpo", "model.lora.rank=8.0"], "model.lora.rank"),
    ("wrong_type", ["data.reward_timeout_s=ten"], "data.reward_timeout_s"),
    # --- out-of-range ints: 0 / negative counts and sizes -----------------------------------
    ("int_range", ["rollout.group_size=0"], "rollout.group_size"),
    ("int_range", ["rollout.prompts_per_step=0"], "rollout.prompts_per_step"),
    ("int_range", ["rollout.prompts_per_step=-4"], "rollout.prompts_per_step"),
    ("int_range", ["rollout.sampling.max_tokens=0"], "rollout.sampling.max_tokens"),
    ("int_range", ["rollout.sampling.max_tokens=-1"], "rollout.sampling.max_tokens"),
    ("int_range", ["rollout.sampling.top_k=0"], "rollout.sampling.top_k"),
    ("int_range", ["recipe=async_grpo", "rollout.max_inflight=0"], "rollout.max_inflight"),
    ("int_range", ["recipe=async_grpo", "rollout.max_staleness=-1"], "rollout.max_staleness"),
    ("int_range", ["recipe=async_grpo", "rollout.buffer_capacity=0"], "rollout.buffer_capacity"),
    ("int_range", ["recipe=dapo", "rollout.group_filter.max_rounds=-1"], "rollout.group_filter.max_rounds"),
    ("int_range", ["recipe=dapo", "rollout.overlong.buffer=-1"], "rollout.overlong.buffer"),
    ("int_range", ["algo.minibatches=0"], "algo.minibatches"),
    ("int_range", ["algo.epochs=0"], "algo.epochs"),
    ("int_range", ["algo.micro_batch_size=0"], "algo.micro_batch_size"),
    ("int_range", ["data.train_size=0"], "data.train_size"),
    ("int_range", ["data.eval_size=-1"], "data.eval_size"),
    ("int_range", ["data.eval_samples=-1"], "data.eval_samples"),
    ("int_range", ["data.sync_every=0"], "data.sync_every"),
    ("int_range", ["engine.replicas=0"], "engine.replicas"),
    ("int_range", ["engine.max_model_len=0"], "engine.max_model_len"),
    ("int_range", ["engine.cpu_kvcache_gb=0"], "engine.cpu_kvcache_gb"),
    (
        "int_range",
        ["callbacks.checkpoint.every_n_train_steps=-5"],
        "callbacks.checkpoint.every_n_train_steps",
    ),
    ("int_range", ["callbacks.eval.every_n_versions=-1"], "callbacks.eval.every_n_versions"),
    ("int_range", ["callbacks.weight_sync.lag=-1"], "callbacks.weight_sync.lag"),
    ("int_range", ["module.max_consecutive_skips=-1"], "module.max_consecutive_skips"),
    ("int_range", ["module.forward.row_tokens=0"], "module.forward.row_tokens"),
    ("int_range", ["module.forward.logit_chunk=0"], "module.forward.logit_chunk"),
    ("int_range", ["trainer.max_steps=0"], "trainer.max_steps"),
    ("int_range", ["trainer.devices=0"], "trainer.devices"),
    ("int_range", ["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps"),
    ("int_range", ["+trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches"),
    ("int_range", ["model.lora.rank=-1"], "model.lora.rank"),
    ("int_range", ["recipe=lora_grpo", "model.lora.alpha=0"], "model.lora.alpha"),
    ("int_range", ["recipe=sft_warmup", "data.batch_size=0"], "data.batch_size"),
    ("int_range", ["recipe=sft_warmup", "module.max_new_tokens=0"], "module.max_new_tokens"),
    ("int_range", ["recipe=sft_warmup", "module.scheduler.warmup_steps=-1"], "module.scheduler.warmup_steps"),
    ("int_range", ["torch_threads=-2"], "torch_threads"),
    # --- out-of-range floats --------------------------------------------------------------
    ("float_range", ["rollout.sampling.temperature=0"], "rollout.sampling.temperature"),
    ("float_range", ["rollout.sampling.temperature=-0.5"], "rollout.sampling.temperature"),
    ("float_range", ["rollout.sampling.top_p=0"], "rollout.sampling.top_p"),
    ("float_range", ["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p"),
    ("float_range", ["rollout.sampling.top_p=0.9"], "rollout.sampling.top_p"),  # trainer can't recompute it
    ("float_range", ["algo.objective.eps_low=-0.1"], "algo.objective.eps_low"),
    ("float_range", ["algo.objective.eps_high=-0.2"], "algo.objective.eps_high"),
    ("float_range", ["algo.objective.dual_clip=0.5"], "algo.objective.dual_clip"),  # must be > 1
    ("float_range", ["algo.loss.kl_coef=-0.1"], "algo.loss.kl_coef"),
    ("float_range", ["algo.kl_reward.coef=-0.01"], "algo.kl_reward.coef"),
    ("float_range", ["algo.advantage.eps=-1e-6"], "algo.advantage.eps"),
    ("float_range", ["module.optimizer.lr=-1e-4"], "module.optimizer.lr"),
    ("float_range", ["module.optimizer.betas=[0.9,1.0]"], "module.optimizer.betas"),
    ("float_range", ["module.optimizer.betas=[-0.1,0.99]"], "module.optimizer.betas"),
    ("float_range", ["module.optimizer.weight_decay=-0.01"], "module.optimizer.weight_decay"),
    ("float_range", ["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val"),
    ("float_range", ["engine.startup_timeout_s=0"], "engine.startup_timeout_s"),
    ("float_range", ["engine.stall_timeout_s=-1"], "engine.stall_timeout_s"),
    ("float_range", ["data.reward_timeout_s=0"], "data.reward_timeout_s"),
    ("float_range", ["data.sync_every_s=-1"], "data.sync_every_s"),
    ("float_range", ["recipe=async_grpo", "rollout.max_age_s=0"], "rollout.max_age_s"),
    ("float_range", ["recipe=async_grpo", "+rollout.wait_timeout_s=0"], "rollout.wait_timeout_s"),
    ("float_range", ["recipe=async_grpo", "algo.correction.cap=0"], "algo.correction.cap"),
    ("float_range", ["recipe=partial_grpo", "rollout.over_provision=0.5"], "rollout.over_provision"),
    ("float_range", ["recipe=dapo", "rollout.overlong.penalty=-1"], "rollout.overlong.penalty"),
    ("float_range", ["recipe=ppo", "module.critic.lr=-1e-4"], "module.critic.lr"),
    ("float_range", ["recipe=ppo", "module.critic.gamma=1.5"], "module.critic.gamma"),
    ("float_range", ["recipe=ppo", "module.critic.lam=-0.1"], "module.critic.lam"),
    ("float_range", ["recipe=ppo", "module.critic.coef=-0.5"], "module.critic.coef"),
    ("float_range", ["recipe=ppo", "module.critic.clip=-0.2"], "module.critic.clip"),
    ("float_range", ["recipe=ppo", "module.critic.rho_bar=0"], "module.critic.rho_bar"),
    ("float_range", ["callbacks.weight_sync.tolerance=-1"], "callbacks.weight_sync.tolerance"),
    ("float_range", ["+engine.gpu_memory_utilization=0"], "engine.gpu_memory_utilization"),
    ("float_range", ["recipe=sft_warmup", "trainer.val_check_interval=0"], "trainer.val_check_interval"),
    # --- non-finite: inf / -inf / nan (only module.critic.rho_bar / c_bar take inf) ---------
    ("non_finite", ["rollout.sampling.temperature=inf"], "rollout.sampling.temperature"),
    ("non_finite", ["rollout.sampling.temperature=nan"], "rollout.sampling.temperature"),
    ("non_finite", ["rollout.sampling.top_p=nan"], "rollout.sampling.top_p"),
    ("non_finite", ["module.optimizer.lr=inf"], "module.optimizer.lr"),
    ("non_finite", ["module.optimizer.lr=nan"], "module.optimizer.lr"),
    ("non_finite", ["module.optimizer.weight_decay=inf"], "module.optimizer.weight_decay"),
    ("non_finite", ["module.optimizer.betas=[0.9,nan]"], "module.optimizer.betas"),
    ("non_finite", ["algo.loss.kl_coef=inf"], "algo.loss.kl_coef"),
    ("non_finite", ["algo.kl_reward.coef=nan"], "algo.kl_reward.coef"),
    ("non_finite", ["algo.objective.eps_high=inf"], "algo.objective.eps_high"),
    ("non_finite", ["algo.objective.eps_low=-inf"], "algo.objective.eps_low"),
    ("non_finite", ["trainer.gradient_clip_val=inf"], "trainer.gradient_clip_val"),
    ("non_finite", ["trainer.gradient_clip_val=nan"], "trainer.gradient_clip_val"),
    ("non_finite", ["engine.stall_timeout_s=inf"], "engine.stall_timeout_s"),
    ("non_finite", ["data.reward_timeout_s=inf"], "data.reward_timeout_s"),
    ("non_finite", ["recipe=async_grpo", "algo.correction.cap=inf"], "algo.correction.cap"),
    ("non_finite", ["recipe=partial_grpo", "rollout.over_provision=inf"], "rollout.over_provision"),
    ("non_finite", ["recipe=ppo", "module.critic.gamma=nan"], "module.critic.gamma"),
    ("non_finite", ["recipe=ppo", "module.critic.rho_bar=nan"], "module.critic.rho_bar"),  # nan never
    ("non_finite", ["recipe=ppo", "module.critic.c_bar=-inf"], "module.critic.c_bar"),
    # --- unknown choices for string fields ------------------------------------------------
    ("bad_choice", ["algo.loss.anchor=decoupeld"], "algo.loss.anchor"),
    ("bad_choice", ["algo.loss.aggregation=mean"], "algo.loss.aggregation"),
    ("bad_choice", ["algo.loss.kl_kind=k4"], "algo.loss.kl_kind"),
    ("bad_choice", ["recipe=async_grpo", "rollout.inflight=drop"], "rollout.inflight"),
    ("bad_choice", ["data.reward_errors=ignore"], "data.reward_errors"),
    ("bad_choice", ["engine.dtype=fp16"], "engine.dtype"),
    ("bad_choice", ["trainer.precision=fp32"], "trainer.precision"),
    ("bad_choice", ["engine.weight_transfer=nvlink"], "engine.weight_transfer"),
    ("bad_choice", ["engine.executor=ray"], "engine.executor"),
    ("bad_choice", ["rollout.schedule=lifo"], "rollout.schedule"),
    ("bad_choice", ["trainer.accelerator=tpu"], "trainer.accelerator"),
    ("bad_choice", ["trainer.strategy=ddp_spawnn"], "trainer.strategy"),
    ("bad_choice", ["recipe=lora_grpo", "model.lora.target_modules=everything"], "model.lora.target_modules"),
    # --- config groups: set with a dot, or an option that does not exist -------------------
    ("group_syntax", ["recipe=async_grpo", "rollout.staleness=throttle"], "rollout.staleness"),
    ("group_syntax", ["recipe=async_grpo", "rollout.selection=stratified"], "rollout.selection"),
    ("group_syntax", ["algo.correction=tis"], "algo.correction"),
    ("group_syntax", ["algo.advantage=running"], "algo.advantage"),
    ("group_syntax", ["recipe=async_grpo", "rollout/staleness=foo"], "rollout/staleness"),
    ("group_syntax", ["algo/correction=tiss"], "algo/correction"),
    ("group_syntax", ["algo/objective=ppo"], "algo/objective"),
    ("group_syntax", ["recipe=grpo"], "recipe"),
    ("group_syntax", ["rollout=async"], "rollout"),
    ("group_syntax", ["engine=vllm_tpu"], "engine"),
    ("group_syntax", ["task=remainderr"], "task"),
    ("group_syntax", ["rollout/staleness=drop"], "rollout/staleness"),  # sync rollout has no staleness
    (
        "group_syntax",
        ["recipe=async_grpo", "rollout.staleness.max_staleness=1"],
        "rollout.staleness.max_staleness",
    ),
    # --- misspelt keys, with and without + -----------------------------------------------
    ("misspelt_key", ["+rollout.sampling.temprature=0.5"], "rollout.sampling.temprature"),
    ("misspelt_key", ["rollout.sampling.temprature=0.5"], "rollout.sampling.temprature"),
    ("misspelt_key", ["+algo.loss.kl_coeff=0.0"], "algo.loss.kl_coeff"),
    ("misspelt_key", ["algo.minibatch=2"], "algo.minibatch"),
    ("misspelt_key", ["+module.optimizer.learning_rate=1e-4"], "module.optimizer.learning_rate"),
    ("misspelt_key", ["+trainer.max_step=10"], "trainer.max_step"),
    ("misspelt_key", ["+engine.gpu_memory_util=0.5"], "engine.gpu_memory_util"),
    ("misspelt_key", ["+data.trainsize=100"], "data.trainsize"),
    ("misspelt_key", ["+callbacks.weight_sync.lags=1"], "callbacks.weight_sync.lags"),
    ("misspelt_key", ["+rollout.max_staleness=1"], "rollout.max_staleness"),  # a streaming key on sync
    ("misspelt_key", ["recipe=lora_grpo", "+model.lora.ranks=8"], "model.lora.ranks"),
    ("misspelt_key", ["recipe=ppo", "+module.critic.gama=0.9"], "module.critic.gama"),
    ("misspelt_key", ["+seedd=1"], "seedd"),  # top level: builds nothing
    ("misspelt_key", ["+ckpt=last"], "ckpt"),  # meant ckpt_path
    ("misspelt_key", ["+algo.kl_coef=0.1"], "algo.kl_coef"),  # meant algo.loss.kl_coef
    ("misspelt_key", ["+model.lr=1e-4"], "model.lr"),  # model.* builds nothing either
    # --- paths of the wrong kind ---------------------------------------------------------
    ("path_kind", ["model.path=README.md"], "model.path"),
    ("path_kind", ["model.path=/work/main/artifacts"], "model.path"),  # a dir without config.json
    ("path_kind", ["model.path=tiny-qwen-sft"], "model.path"),  # relative to the cwd, not artifacts/
    ("path_kind", ["model.path=artifacts/tiny-qwen-stf"], "model.path"),  # typo with one '/': not a hub id
    ("path_kind", ["model.path=''"], "model.path"),
    ("path_kind", ["module.ref_model_path=README.md"], "module.ref_model_path"),
    ("path_kind", ["ckpt_path=README.md"], "ckpt_path"),
    ("path_kind", ["ckpt_path=/work/main/artifacts"], "ckpt_path"),  # a directory
    ("path_kind", ["ckpt_path=last.ckpt"], "ckpt_path"),
    ("path_kind", ["task=gsm8k"], "task.dataset"),  # no local dataset, offline=false
    ("path_kind", ["task=math"], "task.train_dataset"),
    ("path_kind", ["recipe=sft_warmup", "model.base_path=README.md"], "model.base_path"),
    ("path_kind", ["recipe=ppo", "module.critic.model_path=README.md"], "module.critic.model_path"),
    ("path_kind", ["callbacks.save_hf.dirpath=README.md"], "callbacks.save_hf.dirpath"),  # a file, not a dir
    # --- absurd sizes: values no researcher means ------------------------------------------
    ("absurd_size", ["model.lora.rank=4096"], "model.lora.rank"),  # hidden_size is 128
    ("absurd_size", ["recipe=lora_grpo", "model.lora.rank=4096"], "model.lora.rank"),
    ("absurd_size", ["recipe=async_grpo", "rollout.max_inflight=100000"], "rollout.max_inflight"),
    ("absurd_size", ["recipe=async_grpo", "rollout.buffer_capacity=100000000"], "rollout.buffer_capacity"),
    ("absurd_size", ["data.train_size=10000000000"], "data.train_size"),
    ("absurd_size", ["data.eval_size=100000000"], "data.eval_size"),
    ("absurd_size", ["data.eval_samples=100000"], "data.eval_samples"),
    ("absurd_size", ["engine.max_model_len=4096"], "engine.max_model_len"),  # the model has 512 positions
    ("absurd_size", ["rollout.sampling.max_tokens=400"], "rollout.sampling.max_tokens"),  # == max_model_len
    ("absurd_size", ["rollout.sampling.max_tokens=100000"], "rollout.sampling.max_tokens"),
    ("absurd_size", ["engine.cpu_kvcache_gb=100000"], "engine.cpu_kvcache_gb"),
    ("absurd_size", ["engine.max_num_seqs=0"], "engine.max_num_seqs"),
    ("absurd_size", ["engine.replicas=64"], "engine.replicas"),  # more than this machine's cores
    ("absurd_size", ["rollout.prompts_per_step=1000000"], "rollout.prompts_per_step"),
    ("absurd_size", ["rollout.group_size=100000"], "rollout.group_size"),
    ("absurd_size", ["torch_threads=1024"], "torch_threads"),
    ("absurd_size", ["recipe=partial_grpo", "rollout.over_provision=1000"], "rollout.over_provision"),
    (
        "absurd_size",
        ["recipe=async_grpo", "rollout.max_staleness=100000"],
        "rollout.max_staleness",
    ),  # auto sizing scales with K
    # --- cross-field contradictions --------------------------------------------------------
    ("cross_field", ["module.temperature=0.7"], "module.temperature"),
    ("cross_field", ["algo.minibatches=200"], "algo.minibatches"),  # > 16 x 8 samples
    ("cross_field", ["trainer.devices=3"], "trainer.devices"),  # 3 ranks do not divide 128
    ("cross_field", ["recipe=async_grpo", "callbacks.weight_sync.lag=1"], "callbacks.weight_sync.lag"),
    ("cross_field", ["+data.eval_max_tokens=400"], "data.eval_max_tokens"),
    ("cross_field", ["rollout.sampling.max_tokens=390"], "rollout.sampling.max_tokens"),
    (
        "cross_field",
        ["algo.minibatches=2", "callbacks.checkpoint.every_n_train_steps=3"],
        "callbacks.checkpoint.every_n_train_steps",
    ),
    ("cross_field", ["recipe=async_grpo", "rollout.buffer_capacity=8"], "rollout.buffer_capacity"),
    (
        "cross_field",
        ["recipe=async_grpo", "rollout/staleness=recompute"],
        "rollout.staleness",
    ),  # decoupled anchor
    (
        "cross_field",
        ["recipe=async_grpo", "rollout.max_staleness=null"],
        "rollout.max_staleness",
    ),  # with auto sizing
    ("cross_field", ["rollout.group_size=1"], "rollout.group_size"),  # group advantage is always 0
    ("cross_field", ["recipe=dapo", "rollout.group_size=1"], "rollout.group_size"),
    (
        "cross_field",
        ["recipe=async_grpo", "rollout/staleness=admit", "rollout/selection=stratified"],
        "rollout.selection",
    ),
    (
        "cross_field",
        ["recipe=async_grpo", "data.sync_every_s=5"],
        "data.sync_every_s",
    ),  # throttle counts versions
    ("cross_field", ["engine.weight_transfer=nccl"], "engine.weight_transfer"),  # trainer on CPU
    (
        "cross_field",
        ["recipe=async_grpo", "algo/advantage=running", "rollout/staleness=admit"],
        "algo.advantage",
    ),
    (
        "cross_field",
        ["module.ref_model_path=null"],
        "module.ref_model_path",
    ),  # algo.loss.kl_coef=0.1 needs it
    (
        "cross_field",
        ["recipe=dapo", "rollout.overlong.buffer=400"],
        "rollout.overlong.buffer",
    ),  # >= max_tokens
    ("int_range", ["recipe=sft_warmup", "module.scheduler.warmup_steps=-5"], "module.scheduler.warmup_steps"),
    (
        "cross_field",
        ["trainer.devices=2", "algo.minibatches=3", "callbacks.checkpoint.every_n_train_steps=21"],
        "trainer.devices",
    ),  # 2 x 3 does not divide 128
    # --- interpolation typos --------------------------------------------------------------
    ("interpolation", ["model.path=${model.pth}"], "model.path"),
    ("interpolation", ["module.temperature=${rollout.sampling.temprature}"], "module.temperature"),
    ("interpolation", ["engine.seed=${sed}"], "engine.seed"),
    ("interpolation", ["data.train_size=${oc.env:ASYNCRL_TRAIN_SIZE_UNSET}"], "data.train_size"),
    ("interpolation", ["model.path=${paths.artifact_dir}/tiny-qwen-sft"], "model.path"),
    ("interpolation", ["trainer.max_steps=${algo.minibatch}"], "trainer.max_steps"),
    ("interpolation", ["module.ref_model_path=${model.path"], "module.ref_model_path"),  # unbalanced
    (
        "interpolation",
        ["callbacks.checkpoint.dirpath=${path.output_dir}/ckpt"],
        "callbacks.checkpoint.dirpath",
    ),
    # --- override syntax / deleting required fields -------------------------------------
    ("syntax", ["rollout.group_size==8"], "rollout.group_size"),
    ("syntax", ["rollout.group_size"], "rollout.group_size"),
    ("syntax", ["trainer.devices=[0,1"], "trainer.devices"),
    ("syntax", ["~rollout.group_size"], "rollout.group_size"),
    ("syntax", ["~model.path"], "model.path"),
    (
        "syntax",
        ["rollout.sampling.temperature=0,7"],
        "rollout.sampling.temperature",
    ),  # comma: a sweep, not -m
]

GOOD: list[list[str]] = [
    ["recipe=ppo", "rollout.group_size=1"],  # the critic's advantages: one response is fine
    ["recipe=ppo", "module.critic.rho_bar=inf"],  # untruncated V-trace (documented)
    ["recipe=ppo", "module.critic.rho_bar=inf", "module.critic.c_bar=inf"],
    ["recipe=async_grpo", "rollout.max_staleness=0"],  # on-policy streaming
    ["recipe=partial_grpo", "rollout.max_staleness=null"],  # unbounded, fixed over-provisioning
    ["recipe=async_grpo", "algo/advantage=running", "rollout.group_size=1"],
    ["rollout=streaming", "rollout.group_size=1", "algo/advantage=running"],
    ["rollout.sampling.temperature=0.7"],  # module.temperature follows by interpolation
    [
        "algo.minibatches=128",
        "callbacks.checkpoint.every_n_train_steps=128",
    ],  # one sample per minibatch: == P x G
    ["data.eval_size=0"],  # no held-out evaluation
    ["recipe=lora_grpo", "model.lora.rank=1"],
    ["algo.loss.kl_coef=0", "module.ref_model_path=null"],  # no KL, no reference model
    ["trainer.gradient_clip_val=null"],
    ["recipe=async_grpo", "rollout/staleness=drop", "rollout.max_staleness=0"],
    ["recipe=async_grpo", "rollout.max_inflight=1", "rollout.buffer_capacity=16"],
    [
        "recipe=async_grpo",
        "rollout.max_staleness=null",
        "rollout.max_inflight=32",
        "rollout.buffer_capacity=64",
    ],
    ["trainer.devices=2", "callbacks.checkpoint.every_n_train_steps=20"],  # 2 CPU ranks divide 128
    ["rollout.sampling.max_tokens=384", "+data.eval_max_tokens=256"],
    ["engine.max_model_len=512", "rollout.sampling.max_tokens=496"],  # exactly the model's positions
    ["recipe=dapo"],
    ["recipe=sft_warmup"],
]
