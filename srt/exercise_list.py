"""The paper's equations as exercises, the table of them: each exercise's function, equation,
section, hint and checks, in the order a class does them, and how a blank that a command reaches is
named ("calls reward.format_reward, exercise eq5, which is not done yet").

It imports nothing of the project, so that every script (srt.config.interruptible) can name a blank
without importing the copy machinery of srt/exercises.py, which reads the run harness's flags.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Exercise:
    key: str  # what the grader prints: "PASS eq8 group_advantages"
    function: str  # "module:function", the module's file relative to the project root
    equation: str  # the paper's equation, as the NotImplementedError names it
    section: str  # the paper's section
    hint: str  # printed by the blank and by a failed grade; never the solution
    checks: tuple[str, ...]  # "check_module:function" in tests/exercises/, run in order

    @property
    def name(self) -> str:
        return self.function.partition(":")[2]

    @property
    def module(self) -> str:
        return self.function.partition(":")[0]

    @property
    def path(self) -> Path:
        """The module's file, relative to the project (or the copy's) root."""
        return Path(*self.module.split(".")).with_suffix(".py")

    def message(self) -> str:
        return f"{self.equation}, {self.section}: {self.hint}"


# In the order a class does them: stage 0, stage 1, the reward, then GRPO.
EXERCISES = [
    Exercise(
        "eq2",
        "stage0_build:dependency_score",
        "Eq. (2)",
        "§3.2",
        "the paper's Eq. (2) with the weights and decay the signature names; the docstring says what "
        "t and i are, and that arrays come in",
        (
            "check_stage0:score_by_hand",
            "check_stage0:decay_reads_the_distance",
            "check_stage0:works_on_arrays",
        ),
    ),
    Exercise(
        "eq3",
        "stage1_sft:sft_loss_sums",
        "Eq. (3)",
        "§3.3",
        "read srt/logprobs.py's target_logprobs (what it returns, from which column) and "
        "stage1_sft.collate (what labels and answer_mask hold); the docstring names the six sums",
        (
            "check_sft:sums_match_a_forward_by_hand",
            "check_sft:prompt_and_padding_carry_no_loss",
            "check_sft:one_step_lowers_the_target_nll",
        ),
    ),
    Exercise(
        "eq5",
        "reward:format_reward",
        "Eq. (5)",
        "§3.4",
        "the docstring's six rules are is_valid; read srt/completion.py for what already checks them",
        (
            "check_reward:format_accepts_the_honest_completion",
            "check_reward:format_fails_a_missing_marker",
            "check_reward:format_fails_a_tag_outside_the_think_block",
            "check_reward:format_fails_nested_or_out_of_order_tags",
        ),
    ),
    # Eq. (6)'s IoU, which reward.recall_reward scales; one definition, so that the reward and the
    # evaluation's recall Jaccard cannot disagree, and no second IoU stays in the copy.
    Exercise(
        "eq6",
        "srt.metrics:jaccard",
        "Eq. (6)",
        "§3.4",
        "the IoU inside Eq. (6), on sets, as the docstring writes it (reward.py's recall_reward "
        "scales it); what do two empty sets give?",
        (
            "check_reward:iou_at_its_bounds",
            "check_reward:iou_by_hand",
            "check_reward:iou_charges_over_recall",
            "check_reward:recall_reward_scales_the_iou",
        ),
    ),
    Exercise(
        "eq7",
        "reward:answer_cosines",
        "Eq. (7)",
        "§3.4",
        "read srt/embedder.py's embed (what its rows are) and the docstring (one call; a missing "
        "answer); a real embedder rounds",
        (
            "check_reward:cosine_by_hand",
            "check_reward:cosine_against_each_answers_own_reference",
            "check_reward:cosine_of_a_missing_answer",
            "check_reward:cosine_in_one_embedding_call",
        ),
    ),
    Exercise(
        "eq4",
        "reward:compute_rewards",
        "Eq. (4)",
        "§3.4",
        "Eq. (4) from the parts above: read the module docstring (alignment, the gate) and what "
        "parse_completion, match_tags, recall_sets and answer_rewards return",
        (
            "check_reward:composite_of_the_honest_completion",
            "check_reward:composite_is_the_sum_of_its_parts",
            "check_reward:composite_matches_the_gallery_row_by_row",
            "check_reward:composite_of_a_completion_without_a_final_answer",
            "check_reward:composite_applies_the_answer_gate",
            "check_reward:composite_refuses_mismatched_lengths",
        ),
    ),
    Exercise(
        "eq8",
        "stage2_grpo:group_advantages",
        "Eq. (8)",
        "§3.4",
        "Eq. (8) per row (group); the docstring decides the std, the dtypes, the all-equal group, a "
        "NaN and each scale",
        (
            "check_grpo:advantages_by_hand",
            "check_grpo:advantages_of_a_group_sum_to_zero",
            "check_grpo:an_all_equal_group_gets_exactly_zero",
            "check_grpo:a_nan_reward_leaves_its_group_nan",
            "check_grpo:advantages_under_every_scale",
        ),
    ),
    Exercise(
        "kl",
        "stage2_grpo:k3_kl",
        "Eq. (9)'s KL term",
        "§3.4",
        "the k3 estimator the docstring names (mind the direction of the log-ratio); "
        "docs/grpo-step.md works one token by hand",
        ("check_grpo:k3_is_zero_when_the_policies_agree", "check_grpo:k3_by_hand"),
    ),
    # Eq. (9)'s ratio and GSPO's, side by side (importance_ratio); grpo_loss calls it, so it comes first.
    Exercise(
        "gspo",
        "stage2_grpo:importance_ratio",
        "Eq. (9)'s ratio and GSPO's s_i",
        "§3.4; GSPO §4.1",
        "the token level is the r_{i,t} of Eq. (9); for the sequence level read GSPO's (Zheng et al., "
        "2025) definition of s_i(theta), its length normalisation, and its §5.1 clipping range; the "
        "docstring says which epsilon each level takes and what a masked token holds",
        (
            "check_grpo:token_ratio_and_its_clip",
            "check_grpo:sequence_ratio_by_hand",
            "check_grpo:sequence_ratio_clips_with_its_own_epsilon",
            "check_grpo:clip_higher_moves_the_upper_bound_alone",
            "check_grpo:sequence_ratio_has_every_tokens_gradient",
        ),
    ),
    Exercise(
        "eq9",
        "stage2_grpo:grpo_loss",
        "Eq. (9)",
        "§3.4",
        "Eq. (9) as the docstring and TokenTerms describe it, its ratio and clip from importance_ratio "
        "(exercise gspo); read Experience's fields; docs/grpo-step.md works one token by hand",
        (
            "check_grpo:loss_by_hand",
            "check_grpo:the_clip_acts_for_both_signs",
            "check_grpo:a_masked_token_gets_no_gradient",
            "check_grpo:the_kl_term_and_the_importance_weights",
            "check_grpo:the_loss_weights_weigh_every_token",
            "check_grpo:the_level_and_the_epsilons_reach_the_ratio",
            "check_grpo:one_step_raises_the_best_completion",
        ),
    ),
    Exercise(
        "weights",
        "stage2_grpo:loss_weights",
        "Eq. (9)'s normalisation",
        "§3.4",
        "LOSS_TYPES above the function states each normalisation; the docstring says what G, N and "
        "the ranks are",
        (
            "check_grpo:grpo_weights_by_hand",
            "check_grpo:grpo_weights_count_every_row",
            "check_grpo:dapo_weights_by_hand",
            "check_grpo:dr_grpo_has_no_length_bias",
        ),
    ),
]


def exercise_that_raised(error: BaseException, exercises=EXERCISES) -> Exercise | None:
    """The exercise whose function raised `error` (its innermost frame that is one): in a student's
    copy, the blank that a NotImplementedError came from, however deep the call."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        for exercise in exercises:
            if frame.name == exercise.name and Path(frame.filename).parts[-len(exercise.path.parts) :] == (
                exercise.path.parts
            ):
                return exercise
    return None


def unfinished_exercise(error: NotImplementedError) -> str:
    """What a caller says when a function it needs is still a blank: "calls reward.format_reward,
    exercise eq5, which is not done yet"."""
    exercise = exercise_that_raised(error)
    if exercise is None:
        return f"raised NotImplementedError: {error}"
    return (
        f"calls {exercise.module}.{exercise.name}, exercise {exercise.key}, which is not done yet: "
        f"do {exercise.key} first (python -m srt.exercises --grade DIR)"
    )
