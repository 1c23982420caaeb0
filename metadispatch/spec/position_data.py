"""The ops whose tensors' values are data, never positions, by family (Note [Values that become positions]).

Read by trust/positions.py after its tables of ops that follow values and the
families it refuses, and after two rules that need no list (ops tagged
``torch.Tag.pointwise``, ops that read no tensor).  An op here computes on
its inputs' values -- adds them, reduces them, copies, multiplies,
convolves, normalises, sorts them -- and takes every position it touches
from sizes, strides and integer parameters its kernel checks (a dimension is
wrapped and bounds-checked, a view's extent is checked against its storage by
``as_strided`` or by replay's view fence).  Names are packets without the
overload; an in-place form (``relu_``) shares its packet's entry.  A family
is written out name by name so that a new op in it (torch 2.x adds some each
release) is unclassified until someone looks at it
(tests/trust/test_positions.py).
"""

from __future__ import annotations

__all__ = ["DATA_FAMILIES"]

_FAMILIES = {
    "elementwise on its inputs' values (forms and aliases torch does not tag pointwise)": """
        _add_relu _conj _conj_copy _conj_physical _dirichlet_grad _masked_scale _neg_view _neg_view_copy
        _standard_gamma_grad abs absolute add arccos arccosh arcsin arcsinh arctan arctan2 arctanh bitwise_and
        bitwise_left_shift bitwise_or bitwise_right_shift bitwise_xor celu chalf clip complex conj copysign div
        divide elu elu_backward eq fix floor_divide gcd ge gelu gelu_backward glu glu_backward glu_backward_jvp
        glu_jvp greater greater_equal gt hardshrink hardshrink_backward hardsigmoid hardsigmoid_backward
        hardswish hardswish_backward hardtanh hardtanh_backward heaviside imag
        infinitely_differentiable_gelu_backward isclose isin isinf isnan isreal le leaky_relu
        leaky_relu_backward less less_equal log_sigmoid log_sigmoid_backward log_sigmoid_forward lt masked_fill
        mish mish_backward mul multiply ne negative not_equal polar prelu _prelu_kernel _prelu_kernel_backward
        real relu relu6 remainder rrelu rrelu_with_noise rrelu_with_noise_backward rrelu_with_noise_functional
        rsub softplus softplus_backward softshrink softshrink_backward sub subtract threshold threshold_backward
        true_divide where xlogy special_digamma special_erf special_erfc special_erfinv special_exp2
        special_expit special_expm1 special_gammainc special_gammaincc special_gammaln special_i0 special_log1p
        special_logit special_multigammaln special_ndtr special_polygamma special_psi special_round special_sinc
        special_xlogy native_dropout native_dropout_backward dropout alpha_dropout feature_dropout
        feature_alpha_dropout _fused_dropout _cast_Byte _cast_Char _cast_Double _cast_Float _cast_Half _cast_Int
        _cast_Long _cast_Short hash_tensor _philox_key_fold_in _philox_key_split _philox_normal _philox_uniform
        _fill_mem_eff_dropout_mask _foobar
    """,
    "a reduction, scan, sort or search over its input's values (indices are outputs)": """
        _aminmax _cummax_helper _cummin_helper _histogramdd_bin_edges _histogramdd_from_bin_cts
        _histogramdd_from_bin_tensors _is_all_true _is_any_true _local_scalar_dense _logcumsumexp _unique
        _unique2 all allclose amax amin aminmax any argmax argmin argsort argwhere bucketize count_nonzero
        cummax cummin cumprod cumprod_backward cumsum cumulative_trapezoid diff dist frobenius_norm gradient
        histc histogram histogramdd item kthvalue linalg__powsum linalg_matrix_norm linalg_norm
        linalg_vector_norm logcumsumexp logsumexp max mean median min mode msort nanmean nanmedian nanquantile
        nansum native_norm nonzero nonzero_numpy nonzero_static norm norm_except_dim nuclear_norm prod quantile
        sort special_logsumexp std std_mean sum topk trace trace_backward trapezoid trapz unique_consecutive
        unique_dim unique_dim_consecutive var var_mean masked_select masked_select_backward combinations
    """,
    "a view, reshape or move of its input: positions from sizes and strides the kernel or the view fence checks": """
        _reshape_alias _reshape_alias_copy _reshape_copy _reshape_from_tensor _unsafe_view adjoint alias
        alias_copy as_strided as_strided_copy as_strided_scatter atleast_1d atleast_2d atleast_3d
        broadcast_tensors broadcast_to chunk detach detach_copy diag diag_embed diagflat diagonal
        diagonal_backward diagonal_copy diagonal_scatter dsplit expand expand_as expand_copy flatten flip fliplr
        flipud hsplit linalg_diagonal mH mT matrix_H movedim moveaxis narrow_copy numpy_T permute permute_copy
        ravel reshape reshape_as roll rot90 select select_backward select_copy select_scatter slice
        slice_backward slice_copy slice_inverse slice_scatter split split_copy split_with_sizes
        split_with_sizes_copy squeeze squeeze_copy swapaxes swapdims t t_copy transpose transpose_copy unbind
        unbind_copy unflatten unfold unfold_copy unsafe_chunk unsafe_split unsafe_split_with_sizes unsqueeze
        unsqueeze_copy view view_as view_as_complex view_as_complex_copy view_as_real view_as_real_copy
        view_copy vsplit tril triu tile repeat sum_to_size fill_diagonal channel_shuffle native_channel_shuffle
        pixel_shuffle pixel_unshuffle
    """,
    "a copy, conversion or join of its inputs": """
        _autocast_to_full_precision _autocast_to_reduced_precision _chunk_cat _copy_from _copy_from_and_resize
        _lazy_clone _pin_memory _stack _to_copy _to_cpu block_diag cartesian_prod cat clone column_stack concat
        concatenate contiguous copy data dstack flatten_dense_tensors hstack lift lift_fresh lift_fresh_copy
        meshgrid pad_sequence pin_memory resolve_conj resolve_neg row_stack stack to type_as
        unflatten_dense_tensors vstack fill zero set set_data shallow_copy_data
    """,
    "a factory or random fill like its argument: sizes from its arguments, which the budget counts": """
        _dim_arange _new_zeros_with_same_feature_meta _resize_output _sample_dirichlet _standard_gamma bernoulli
        binomial cauchy empty_like exponential full_like geometric log_normal multinomial new_empty
        new_empty_strided new_full new_ones new_zeros normal normal_functional ones_like poisson rand_like
        randint_like randn_like random resize resize_as uniform zeros_like linspace logspace
    """,
    "linear algebra on its inputs' values (pivots are outputs, or checked where they are inputs)": """
        _addmm_activation _cholesky_solve_helper _compute_linear_combination _int_mm _linalg_det _linalg_eigh
        _linalg_eigvals _linalg_slogdet _linalg_solve_ex _linalg_svd _lu_with_info _scaled_mm _scaled_mm_v2
        _trilinear addbmm addmm addmv addr baddbmm bilinear bmm chain_matmul cholesky cholesky_inverse
        cholesky_solve corrcoef cov cross det dot einsum geqrf ger inner inverse kron linalg_cholesky
        linalg_cholesky_ex linalg_cond linalg_cross linalg_det linalg_eig linalg_eigh linalg_eigvals
        linalg_eigvalsh linalg_householder_product linalg_inv linalg_inv_ex linalg_ldl_factor
        linalg_ldl_factor_ex linalg_lstsq linalg_lu linalg_lu_factor linalg_lu_factor_ex linalg_matmul
        linalg_matrix_exp linalg_matrix_power linalg_matrix_sqrth linalg_polar linalg_matrix_rank linalg_multi_dot linalg_pinv linalg_qr
        linalg_slogdet linalg_solve linalg_solve_ex linalg_solve_triangular linalg_svd linalg_svdvals
        linalg_tensorinv linalg_tensorsolve linalg_vander linalg_vecdot linear linear_backward logdet matmul
        matmul_backward matrix_exp matrix_exp_backward matrix_power mm mv orgqr ormqr outer pinverse qr slogdet
        svd tensordot triangular_solve vander vdot _cdist_forward _euclidean_dist _pdist_forward cdist pdist
        pairwise_distance cosine_similarity
    """,
    "convolution, pooling, padding or resampling: positions from sizes and parameters its kernel checks": """
        _adaptive_avg_pool2d _adaptive_avg_pool3d _conv_depthwise2d _convolution _convolution_double_backward
        _convolution_mode _nnpack_spatial_convolution _pad_circular _pad_enum _slow_conv2d_backward
        _slow_conv2d_forward _upsample_nearest_exact1d _upsample_nearest_exact1d_backward
        _upsample_nearest_exact2d _upsample_nearest_exact2d_backward _upsample_nearest_exact3d
        _upsample_nearest_exact3d_backward adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
        adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d affine_grid_generator
        affine_grid_generator_backward avg_pool1d avg_pool2d avg_pool3d col2im constant_pad_nd conv1d conv2d
        conv3d conv_depthwise3d conv_tbc conv_tbc_backward conv_transpose1d conv_transpose2d conv_transpose3d
        convolution convolution_backward convolution_backward_overrideable convolution_overrideable im2col
        max_pool1d max_pool1d_with_indices max_pool2d max_pool2d_with_indices max_pool3d max_pool3d_with_indices
        pad reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d
        replication_pad3d slow_conv3d slow_conv3d_forward slow_conv_dilated2d slow_conv_dilated3d
        slow_conv_transpose2d slow_conv_transpose3d thnn_conv2d upsample_bicubic2d upsample_bicubic2d_backward
        upsample_bilinear2d upsample_bilinear2d_backward upsample_linear1d upsample_linear1d_backward
        upsample_nearest1d upsample_nearest1d_backward upsample_nearest2d upsample_nearest2d_backward
        upsample_nearest3d upsample_nearest3d_backward upsample_trilinear3d upsample_trilinear3d_backward
        cudnn_affine_grid_generator cudnn_affine_grid_generator_backward cudnn_convolution
        cudnn_convolution_add_relu cudnn_convolution_relu cudnn_convolution_transpose cudnn_grid_sampler
        cudnn_grid_sampler_backward
    """,
    "normalization, softmax, loss or attention on floating values": """
        _log_softmax _masked_softmax _native_multi_head_attention _safe_softmax
        _scaled_dot_product_attention_math _scaled_dot_product_cudnn_attention
        _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
        _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_for_cpu
        _scaled_dot_product_fused_attention_overrideable _softmax _transform_bias_rescale_qkv
        _transformer_encoder_layer_fwd _triton_multi_head_attention _triton_scaled_dot_attention _weight_norm
        _weight_norm_differentiable_backward batch_norm_backward_elemt batch_norm_backward_reduce
        batch_norm_gather_stats batch_norm_gather_stats_with_counts batch_norm_stats binary_cross_entropy
        binary_cross_entropy_backward binary_cross_entropy_with_logits cosine_embedding_loss group_norm
        hinge_embedding_loss huber_loss huber_loss_backward kl_div l1_loss layer_norm log_softmax
        margin_ranking_loss mse_loss mse_loss_backward poisson_nll_loss renorm rms_norm
        scaled_dot_product_attention smooth_l1_loss smooth_l1_loss_backward soft_margin_loss
        soft_margin_loss_backward softmax special_log_softmax special_softmax triplet_margin_loss
    """,
    "a recurrent cell on floating values (its kernel checks the gates' sizes)": """
        _thnn_differentiable_gru_cell_backward _thnn_differentiable_lstm_cell_backward _thnn_fused_gru_cell
        _thnn_fused_gru_cell_backward _thnn_fused_lstm_cell _thnn_fused_lstm_cell_backward
        _thnn_fused_lstm_cell_backward_impl gru_cell lstm_cell rnn_relu_cell rnn_tanh_cell _cudnn_rnn
        _cudnn_rnn_backward _cudnn_rnn_flatten_weight
    """,
    "an optimizer or gradient-scaler step on lists of floating tensors (step counts are data)": """
        _amp_foreach_non_finite_check_and_unscale _amp_update_scale _fused_adagrad _fused_adam _fused_adamw
        _fused_sgd
    """,
    "a Fourier transform whose public form wraps and checks its dimensions": """
        fft_fft fft_fft2 fft_fftn fft_fftshift fft_hfft fft_hfft2 fft_hfftn fft_ifft fft_ifft2 fft_ifftn
        fft_ifftshift fft_ihfft fft_ihfft2 fft_ihfftn fft_irfft fft_irfft2 fft_irfftn fft_rfft fft_rfft2
        fft_rfftn stft istft
    """,
    "a question about a tensor's metadata or settings": """
        _debug_has_internal_overlap _fused_sdp_choice _has_compatible_shallow_copy_type _has_same_storage_numel
        _is_zerotensor _shape_as_tensor _use_cudnn_ctc_loss _use_miopen_ctc_loss _version cudnn_is_acceptable
        dim get_device is_complex is_conj is_contiguous is_distributed is_floating_point is_inference is_leaf
        is_neg is_nonzero is_pinned is_same_size is_set_to is_signed numel output_nr requires_grad result_type
        retain_grad retains_grad size storage_offset stride sym_is_contiguous sym_numel sym_size
        sym_storage_offset sym_stride
    """,
}

# prims: torch's primitives, each elementwise, a reduction, a view or a copy; prims.div and the
# FFTs are in positions.py's tables.
_PRIMS = """
    acos acosh add amax amin as_strided as_strided_scatter asin asinh atan atan2 atanh bessel_i0 bessel_i0e
    bessel_i1 bessel_i1e bessel_j0 bessel_j1 bitwise_and bitwise_or bitwise_xor broadcast_in_dim cat cbrt ceil
    clone collapse collapse_view conj copy_strided copy_to cos cosh device_put eq erf erf_inv erfc erfcx exp expm1
    fill floor fmod frexp full_like gcd ge gt imag isfinite item le lgamma log log10 log1p lt mul ndtri ne neg pow
    prod real remainder reshape resize rev round shift_left shift_right_arithmetic sin sinh spherical_bessel_j0
    split_dim sqrt squeeze sub sum svd tan tanh transpose var view_of view_of_dtype where xor_sum zeta
"""

DATA_FAMILIES = {
    **{f"aten::{name}": why for why, names in _FAMILIES.items() for name in names.split()},
    **{
        f"prims::{name}": "one of torch's primitives: elementwise, a reduction, a view or a copy"
        for name in _PRIMS.split()
    },
}
