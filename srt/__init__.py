"""The library the SRT scripts share, as nanochat keeps its own beside its scripts.

The scripts at the top of the repository read like the paper (stage0_build.py §3.2, stage1_sft.py
§3.3, stage2_grpo.py and reward.py §3.4, evaluate.py §4, cuemem.py the CueMem baseline); what they
share lives here, one job a module:

    prompt        the prompt P(Q_t, C_t), the target (Z_t, A*_t), fitting a prompt to a token budget
    loading       loading models and tokenizers, what names their weights, dropout off
    precision     devices and precision: the CPU's bf16 units, the dtype of weights and autocast
    generation    the one batched `generate` every caller uses, and the log-probs of chosen tokens
    embedder      the sentence embedder all-MiniLM-L6-v2 (Eq. (2), Eq. (7))
    decode        the decode loop behind `generate`: one prefill per prompt, a static KV cache, sampling
    rollouts      GRPO's prompt stream and the Rollout record the update reads
    probe         the greedy probes a training run logs (recall Jaccard, F1, format)
    step_page     one GRPO step as an HTML page: K completions side by side, tokens shaded by ratio
    reward_gallery
                  `reward.py --gallery`: the paper's Fig. 1 record attacked, scored by reward.py's reward
    distributed   torchrun set-up, DDP / FSDP wrapping, sharded checkpoints
    checkpoint    atomic save_pretrained folders, trainer state, RNG state, append-only logs
    training      seeding, the learning-rate schedule of §4.1, the wall-clock budget
    config        argparse with presets, flag checks, the resolved config written beside outputs
    data_io       the JSONL record format, the weighted mix of several files, atomic writes
    data/         where stage 0's dialogues come from: the synthetic corpus (synthetic.py, its four
                  domains and their common parts), the readers of LoCoMo, CoQA, MultiWOZ, DailyDialog,
                  ReDial, MG-ShopDial, chit-chat and JSONL (corpora.py), the LLM teachers (teacher.py),
                  the checks that no test answer can be looked up in train (leakage.py)
    metrics       F1, accuracy, recall Jaccard, the error taxonomy, paired bootstrap, McNemar
    locomo_eval   LoCoMo's own per-category answer scoring and evidence recall
    report        Table 2 / Table 3 / Fig. 4 reports and plots
    attention     the §4.6 attention analysis
    memory_plan   the per-GPU memory planner behind --dry-run
"""
