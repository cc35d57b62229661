#!/usr/bin/env python3
"""Coefficients of the CPU prelude's f32 polynomial kernels (include/kiln/codegen/prelude_cpu_math.hpp).

Each function is reduced to a smooth, slowly varying part on a short interval; that part is fitted
with a Chebyshev approximation (mpmath.chebyfit, close to minimax) at 50 digits and the coefficients
are printed rounded to f32, lowest degree first, as the header writes them. The header's tests
(tests/test_cpu_math.cpp) measure the error of the rounded kernels; this script only reproduces the
numbers. Usage: python3 scripts/fit_cpu_math.py
"""
import struct

import mpmath as mp

mp.mp.dps = 50


def f32(x):
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def fit(name, g, lo, hi, degree):
    poly, err = mp.chebyfit(g, [lo, hi], degree + 1, error=True)
    coeffs = [f32(c) for c in reversed(poly)]  # chebyfit gives the highest degree first
    print(f"{name}: degree {degree} on [{float(lo):.6g}, {float(hi):.6g}], fit error {float(err):.3g}")
    print("  " + ", ".join(f"{c:.9g}f" for c in coeffs))


def even_part(f):
    """g(t) = f(sqrt t): a function of x^2 for an even f (guarding t = 0 by its limit)."""
    return lambda t: f(mp.sqrt(t)) if t > 0 else f(mp.mpf("1e-30"))


ln2 = mp.log(2)
# exp(r) = 1 + r + r^2 P(r) on [-ln2/2, ln2/2] (r is x - n ln2).
fit("exp P", lambda r: (mp.exp(r) - 1 - r) / r**2 if r != 0 else mp.mpf(0.5), -ln2 / 2, ln2 / 2, 4)
# log(1 + f) = f - f^2/2 + f^3 Q(f) on [sqrt(1/2) - 1, sqrt(2) - 1] (1 + f is the mantissa).
fit("log Q", lambda f: (mp.log1p(f) - f + f**2 / 2) / f**3 if f != 0 else mp.mpf(1) / 3,
    mp.sqrt(0.5) - 1, mp.sqrt(2) - 1, 8)
# tanh(x) = x + x^3 T(x^2) for |x| < 0.625.
fit("tanh T", even_part(lambda x: (mp.tanh(x) - x) / x**3), 0, mp.mpf(0.625) ** 2, 5)
# erf(x) = x + x E(x^2) for |x| < 1 (the leading x exact: E is small, and so is its rounding).
fit("erf E", even_part(lambda x: mp.erf(x) / x - 1), 0, 1, 6)
# erfc(x) = exp(-x^2) R(1/x) for 1 <= x <= 4 (erf rounds to 1 in f32 beyond about 3.9): in 1/x,
# R is close to its asymptotic series t/sqrt(pi) (1 - t^2/2 + ...), and a low degree fits it.
fit("erfc R", lambda t: mp.erfc(1 / t) * mp.exp(1 / t**2), mp.mpf(0.25), 1, 9)
