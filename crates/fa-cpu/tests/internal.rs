//! fa-cpu's white-box tests: the library compiles them under its `internal-tests` feature
//! (`fa_cpu::internal_tests`, enabled for this crate's tests by its dev-dependency on itself),
//! each `#[test]` here runs one. One copy of the kernel tree serves these and the library's
//! users; a `#[cfg(test)]` unit-test build compiled all of it a second time.
//!
//! The AMX hardware tests need a CPU with AMX tiles and Linux's permission for them; they are
//! ignored by default and run with `--include-ignored` on such a host (there they fail, not
//! skip, if the tiles are missing).

/// One `#[test]` per white-box test of a module of `fa_cpu::internal_tests`.
macro_rules! internal {
    ($module:ident: $($(#[$attr:meta])* $name:ident),* $(,)?) => {
        mod $module {
            $(
                $(#[$attr])*
                #[test]
                fn $name() {
                    fa_cpu::internal_tests::$module::$name()
                }
            )*
        }
    };
}

internal!(amx_tests:
    bf16_pairs_round_like_half_on_every_level,
    emulated_dot_is_the_dot_product_in_f32,
    bf16_bits_round_like_half,
    f16_splits_exactly_into_two_bf16,
    emulated_amx_forward_matches_the_reference_on_every_level,
    emulated_amx_differs_from_the_simd_path_only_by_p_rounding,
    emulated_amx_keeps_f16_scores_exact,
    #[ignore = "needs AMX (Intel Sapphire Rapids or later)"]
    hardware_tiles_match_the_emulation_to_f32_rounding,
    #[ignore = "needs AMX (Intel Sapphire Rapids or later)"]
    hardware_amx_forward_matches_the_emulation_and_the_reference,
);

internal!(amx_backward_tests:
    the_reserved_size_companion_counts_what_the_scratch_allocates,
    emulated_amx_backward_matches_the_reference_on_every_level,
    emulated_amx_backward_writes_half_gradients_within_the_bound,
    emulated_amx_backward_keeps_f16_scores_exact,
    emulated_amx_backward_is_bitwise_identical_for_any_thread_count,
    emulated_amx_backward_differs_from_the_simd_path,
    #[ignore = "needs AMX (Intel Sapphire Rapids or later)"]
    hardware_amx_backward_matches_the_reference_and_the_emulation,
    #[ignore = "needs AMX (Intel Sapphire Rapids or later)"]
    hardware_amx_backward_is_bitwise_identical_for_any_thread_count,
);

internal!(backward_gemm_speed:
    #[ignore = "a timing probe, run by hand"]
    gemm_speed,
);

internal!(backward_twin_tests:
    gemm_matches_the_scalar_twin_and_f64_over_odd_sizes,
    spans_skip_exact_zeros_bitwise,
    tiles_are_whole_blocks_of_every_architecture,
    other_blockings_give_bitwise_the_scalar_gradients,
    gemm_wide_is_gemm_bitwise,
);

internal!(decode_stream_tests:
    stream_kernels_match_scalar_twin_and_f64_f32,
    stream_kernels_match_scalar_twin_and_f64_bf16,
    stream_kernels_match_scalar_twin_and_f64_f16,
    pair_loads_widen_exactly,
    horizontal_sum_and_max,
    strip_transpose_matches_the_definition,
    emulated_amx_decode_matches_the_oracle_on_every_level,
    #[ignore = "needs AMX (Intel Sapphire Rapids or later)"]
    hardware_amx_decode_matches_the_oracle,
    emulated_amx_pv_option_keeps_p_v_in_f32,
    bf16_pair_dots_match_the_oracle,
    bf16_dots_option_takes_the_pair_products,
    bf16_pair_dots_are_two_roundings_from_exact,
    natural_row_undoes_register_order,
);

internal!(twin_tests:
    qk_matches_scalar_twin_and_f64,
    pv_matches_scalar_twin_and_f64,
    exp2_exact_accuracy_and_specials_every_arch,
    exp2_softmax_is_exp2_exact_bit_for_bit_up_to_127_every_arch,
    exp2_cubic_softmax_is_exp2_cubic_bit_for_bit_up_to_127_every_arch,
    exp2_cubic_matches_softmax_core,
    softcap_tanh_matches_f64,
    widen_f16_matches_half,
    detection_is_cached_and_consistent,
    transpose_is_exact_and_touches_nothing_else,
    pack_group_is_exact_for_every_head_dim,
    all_keep_agrees_with_decide,
);

internal!(scratch_tests:
    line_views_start_on_a_cache_line,
);
