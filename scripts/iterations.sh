# Iterated training for scripts/main.sh (sourced, not run): with ITERATIONS=N > 1 the trainer command is handed
# to utils/iterate.py, which trains STEPS_PER_ITERATION steps per iteration (default trainer.total_training_steps
# / ITERATIONS), writes the mistakes analysis and the next iteration's profiles, and continues from the last
# checkpoint. Rerunning the same command resumes an interrupted run. Variables: ITERATIONS (1: no iterations,
# today's single run), STEPS_PER_ITERATION, ITER_ROOT (OUTPUT_DIR/iterations/<experiment>), PROFILES (profiles
# written per iteration, 1000), PROFILE_LLM_URL (an OpenAI-compatible endpoint that writes them; default with
# USER_SIM_MODEL: the first simulator; "rules" or unset on CPU: the rule table), PROFILE_LLM_MODEL (default: the
# first model it serves; its key: PROFILE_LLM_API_KEY or OPENAI_API_KEY),
# RESTART_SIMS (1: restart the simulators this script started before every iteration after the first).

# Check ITERATIONS and derive STEPS_PER_ITERATION and ITER_ROOT (needs STEPS, OUTPUT_DIR and EXPERIMENT: main.sh's
# resolved trainer.total_training_steps and trainer.experiment_name).
sead_check_iterations() {
    ITERATIONS=${ITERATIONS:-1}
    if ! [[ "$ITERATIONS" =~ ^[1-9][0-9]*$ ]]; then
        echo "ITERATIONS must be a positive integer, got '$ITERATIONS'" >&2; exit 2
    fi
    (( ITERATIONS > 1 )) || return 0
    if [[ -z "${STEPS_PER_ITERATION:-}" ]]; then
        if (( STEPS % ITERATIONS != 0 )); then
            echo "trainer.total_training_steps=$STEPS is not a multiple of ITERATIONS=$ITERATIONS; set" \
                 "STEPS_PER_ITERATION" >&2; exit 2
        fi
        STEPS_PER_ITERATION=$((STEPS / ITERATIONS))
    fi
    ITER_ROOT=${ITER_ROOT:-$OUTPUT_DIR/iterations/$EXPERIMENT}
    echo "iterations: $ITERATIONS x $STEPS_PER_ITERATION steps (outputs per iteration under $ITER_ROOT)"
}

# Run utils/iterate.py with TRAIN_CMD (extra arguments, e.g. --dry-run, go to the driver); then point
# ROLLOUT_LOG and VAL_METRICS at the last iteration's files for the summary and the report.
sead_iterate() {
    local -a args=(--iterations "$ITERATIONS" --steps-per-iteration "$STEPS_PER_ITERATION" --root "$ITER_ROOT"
                   --ckpt-dir "$CKPT_DIR" --scenario "$SCENARIO" --train-samples "$TRAIN_SAMPLES"
                   --profiles "${PROFILES:-1000}")
    local llm_url=${PROFILE_LLM_URL:-}
    if [[ -z "$llm_url" && -n "$USER_SIM_MODEL" && "$USER_SIM_URLS" == http* ]]; then llm_url=${USER_SIM_URLS%%,*}; fi
    if [[ -n "$llm_url" && "$llm_url" != rules ]]; then args+=(--llm-url "$llm_url"); fi
    if [[ -n "${PROFILE_LLM_MODEL:-}" ]]; then args+=(--llm-model "$PROFILE_LLM_MODEL"); fi
    if [[ -n "${COMPACT_PROMPT:-}" ]]; then args+=(--system-prompt "$COMPACT_PROMPT"); fi  # the demo's agent prompt
    if [[ "${RESTART_SIMS:-0}" == 1 && "${STARTED_SIMS:-0}" == 1 ]]; then
        args+=(--sim-restart-command "bash scripts/stop_user_sims.sh --run-dir ${RUN_DIR@Q} && \
bash scripts/start_user_sims.sh ${SIM_ARGS[*]@Q}")
    fi
    "$PYTHON" -m utils.iterate "${args[@]}" "$@" -- "${TRAIN_CMD[@]}"
    local last
    last=$ITER_ROOT/iter_$(printf '%02d' "$ITERATIONS")
    ROLLOUT_LOG=$last/rollouts.jsonl
    VAL_METRICS=$last/val_metrics.jsonl
}
