/* Compiled loops, optional: WeightCodec's (extensions/_planes.py encodes, _unplanes.py
 * decodes) and the scan of a checkpoint's metadata pickle before it is unpickled
 * (storage/checkpoint/pickle_scan.py).
 *
 * numpy splits a block into byte planes, packs them, and joins them back in about ten
 * whole-array passes each; each loop here does its part in one, with the GIL released.
 * Without this module (no compiler at install time) the codec runs its numpy passes and
 * the scan its Python loop: the bytes stored and decoded, and the pickles refused, are
 * the same, which the tests check on both paths.
 *
 * Every length is checked here against the others before a byte is written; the
 * caller has checked them against the block already. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Words are assembled in registers and stored with memcpy (any alignment), in the
 * format's byte order, little-endian, whatever the host's. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE16(v) __builtin_bswap16(v)
#define LE32(v) __builtin_bswap32(v)
#else
#define LE16(v) (v)
#define LE32(v) (v)
#endif

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return LE32(v);
}

static inline uint16_t load16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return LE16(v);
}

static inline void store16(uint8_t *p, uint16_t v) {
    v = LE16(v);
    memcpy(p, &v, 2);
}

static inline void store32(uint8_t *p, uint32_t v) {
    v = LE32(v);
    memcpy(p, &v, 4);
}

/* Where the compiler can pick a function's version by the CPU it runs on (GCC or clang,
 * x86-64, glibc: an ifunc), the loops that take most of a decode get an AVX2 version
 * too (twice the elements a step); the build itself still needs only baseline x86-64,
 * and elsewhere they are built once, for the target. Either version writes the same
 * bytes. */
#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__GNUC__) || defined(__clang__))
#define WIDE __attribute__((target_clones("avx2", "default")))
#else
#define WIDE
#endif

/* The top 16 bits of an element from its two top planes; "moved": the second plane
 * from the top holds the sign in bit 7 above 7 bits, the top plane the 8 bits that
 * followed the sign (see extensions/_planes.py). */
static inline uint32_t top16(uint32_t second, uint32_t top, int moved) {
    if (moved)
        return ((second & 0x80u) << 8) | (top << 7) | (second & 0x7Fu);
    return (top << 8) | second;
}

WIDE static void join2(uint8_t *restrict out, const uint8_t *restrict lo,
                  const uint8_t *restrict hi, Py_ssize_t n, int moved) {
    if (moved)
        for (Py_ssize_t i = 0; i < n; i++) store16(out + 2 * i, (uint16_t)top16(lo[i], hi[i], 1));
    else
        for (Py_ssize_t i = 0; i < n; i++) store16(out + 2 * i, (uint16_t)top16(lo[i], hi[i], 0));
}

static void join4(uint8_t *restrict out, const uint8_t *restrict p0,
                  const uint8_t *restrict p1, const uint8_t *restrict p2,
                  const uint8_t *restrict p3, Py_ssize_t n, int moved) {
    if (moved)
        for (Py_ssize_t i = 0; i < n; i++)
            store32(out + 4 * i, p0[i] | (uint32_t)p1[i] << 8 | top16(p2[i], p3[i], 1) << 16);
    else
        for (Py_ssize_t i = 0; i < n; i++)
            store32(out + 4 * i, p0[i] | (uint32_t)p1[i] << 8 | top16(p2[i], p3[i], 0) << 16);
}

/* A LOW_PAIR block of 4-byte elements: the two low bytes of each come stored together. */
static void join4_pair(uint8_t *restrict out, const uint8_t *restrict pair,
                       const uint8_t *restrict p2, const uint8_t *restrict p3, Py_ssize_t n,
                       int moved) {
    if (moved)
        for (Py_ssize_t i = 0; i < n; i++)
            store32(out + 4 * i, load16(pair + 2 * i) | top16(p2[i], p3[i], 1) << 16);
    else
        for (Py_ssize_t i = 0; i < n; i++)
            store32(out + 4 * i, load16(pair + 2 * i) | top16(p2[i], p3[i], 0) << 16);
}

/* The inverse of top16: the second plane from the top and the top plane. */
#define SPLIT_TOP(t, second, top, moved)                                              \
    do {                                                                               \
        if (moved) {                                                                   \
            (second) = (uint8_t)((((t) >> 8) & 0x80u) | ((t) & 0x7Fu));                \
            (top) = (uint8_t)((t) >> 7);                                               \
        } else {                                                                       \
            (second) = (uint8_t)(t);                                                   \
            (top) = (uint8_t)((t) >> 8);                                               \
        }                                                                              \
    } while (0)

static void split2(const uint8_t *restrict in, uint8_t *restrict lo, uint8_t *restrict hi,
                   Py_ssize_t n, int moved) {
    if (moved)
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t t = load16(in + 2 * i);
            SPLIT_TOP(t, lo[i], hi[i], 1);
        }
    else
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t t = load16(in + 2 * i);
            SPLIT_TOP(t, lo[i], hi[i], 0);
        }
}

static void split4(const uint8_t *restrict in, uint8_t *restrict p0, uint8_t *restrict p1,
                   uint8_t *restrict p2, uint8_t *restrict p3, Py_ssize_t n, int moved) {
    if (moved)
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t w = load32(in + 4 * i), t = w >> 16;
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
            SPLIT_TOP(t, p2[i], p3[i], 1);
        }
    else
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t w = load32(in + 4 * i), t = w >> 16;
            p0[i] = (uint8_t)w;
            p1[i] = (uint8_t)(w >> 8);
            SPLIT_TOP(t, p2[i], p3[i], 0);
        }
}

static void release_all(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

PyDoc_STRVAR(join_doc,
"join(out, planes, moved)\n\n"
"Write the elements of 2 or 4 bytes whose byte planes are ``planes`` into ``out``:\n"
"as many planes as bytes per element, each of n bytes, or for 4-byte elements the\n"
"two low bytes of each element as one piece of 2n bytes and the two top planes;\n"
"``out`` holds n elements. ``moved``: the sign was moved (see _planes.py).");

static PyObject *join(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *out_obj, *planes_obj;
    int moved;
    if (!PyArg_ParseTuple(args, "OO!p", &out_obj, &PyTuple_Type, &planes_obj, &moved))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(planes_obj);
    if (count < 2 || count > 4) {
        PyErr_Format(PyExc_ValueError, "join takes 2 to 4 planes, not %zd", count);
        return NULL;
    }
    Py_buffer views[5];
    if (PyObject_GetBuffer(out_obj, &views[0], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int held = 1;
    for (Py_ssize_t j = 0; j < count; j++, held++) {
        PyObject *plane = PyTuple_GET_ITEM(planes_obj, j);
        if (PyObject_GetBuffer(plane, &views[held], PyBUF_C_CONTIGUOUS) < 0) {
            release_all(views, held);
            return NULL;
        }
    }
    /* Two planes: 2-byte elements; three: a 2n-byte low pair and two planes; four:
     * 4-byte elements from four planes. */
    Py_ssize_t n = views[count].len;
    Py_ssize_t es = count == 2 ? 2 : 4;
    int sizes_ok = views[0].len == es * n && views[count - 1].len == n;
    if (count == 3)
        sizes_ok = sizes_ok && views[1].len == 2 * n;
    if (count == 4)
        sizes_ok = sizes_ok && views[1].len == n && views[2].len == n;
    if (!sizes_ok) {
        release_all(views, held);
        PyErr_Format(PyExc_ValueError,
                     "planes of %zd bytes do not make %zd elements of %zd bytes", n,
                     views[0].len / es, es);
        return NULL;
    }
    uint8_t *out = views[0].buf;
    const uint8_t *p[4];
    for (int j = 0; j < count; j++) p[j] = views[j + 1].buf;
    Py_BEGIN_ALLOW_THREADS
    if (count == 2)
        join2(out, p[0], p[1], n, moved);
    else if (count == 3)
        join4_pair(out, p[0], p[1], p[2], n, moved);
    else
        join4(out, p[0], p[1], p[2], p[3], n, moved);
    Py_END_ALLOW_THREADS
    release_all(views, held);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(spread_doc,
"spread(out, codes, k, base, escapes) -> int\n\n"
"Unpack a PACK plane into ``out`` (its n bytes): ``k`` codes (2 or 4) per byte of\n"
"``codes``, lowest bits first; a code below the escape (``2**(8 // k) - 1``) is the\n"
"byte ``base + code`` (mod 256), an escape the next byte of ``escapes``, in order.\n"
"Returns how many escapes the n codes hold, 0 to len(escapes) + 1: the caller\n"
"refuses any count but len(escapes), and out is then incomplete.");

static PyObject *spread(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer out_view, codes_view, escapes_view;
    int k, base;
    if (!PyArg_ParseTuple(args, "w*y*iiy*", &out_view, &codes_view, &k, &base, &escapes_view))
        return NULL;
    Py_ssize_t n = out_view.len, count = codes_view.len, stored = escapes_view.len;
    if ((k != 2 && k != 4) || base < 0 || base > 255 || count != (n + k - 1) / k) {
        PyBuffer_Release(&out_view);
        PyBuffer_Release(&codes_view);
        PyBuffer_Release(&escapes_view);
        PyErr_Format(PyExc_ValueError, "%zd codes, %d to a byte, cannot fill %zd bytes",
                     count, k, n);
        return NULL;
    }
    uint8_t *out = out_view.buf;
    const uint8_t *codes = codes_view.buf, *escapes = escapes_view.buf;
    const uint8_t b = (uint8_t)base;
    const uint8_t escape = (uint8_t)(b + (k == 2 ? 15 : 3));
    Py_ssize_t found = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t whole = n / k;
    if (k == 2)
        for (Py_ssize_t i = 0; i < whole; i++) {
            out[2 * i] = (uint8_t)((codes[i] & 15) + b);
            out[2 * i + 1] = (uint8_t)((codes[i] >> 4) + b);
        }
    else {
        /* Four codes a byte: the four bytes of each code byte from a table (a loop of
         * 2-bit shifts does not vectorize). */
        uint8_t quads[256][4];
        for (int c = 0; c < 256; c++)
            for (int j = 0; j < 4; j++) quads[c][j] = (uint8_t)(((c >> (2 * j)) & 3) + b);
        for (Py_ssize_t i = 0; i < whole; i++) memcpy(out + 4 * i, quads[codes[i]], 4);
    }
    int bits = 8 / k;
    for (Py_ssize_t j = whole * k; j < n; j++)
        out[j] = (uint8_t)(((codes[j / k] >> ((j % k) * bits)) & ((1 << bits) - 1)) + b);
    /* Codes below the escape never land on its byte: base + code < base + escape. */
    uint8_t *at = memchr(out, escape, (size_t)n);
    while (at != NULL && found < stored) {
        *at = escapes[found++];
        at = memchr(at + 1, escape, (size_t)(out + n - (at + 1)));
    }
    if (at != NULL)
        found++; /* more escapes than stored: the count tells the caller so */
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out_view);
    PyBuffer_Release(&codes_view);
    PyBuffer_Release(&escapes_view);
    return PyLong_FromSsize_t(found);
}

PyDoc_STRVAR(split_doc,
"split(planes, words, moved)\n\n"
"The byte planes of ``words`` (n elements of 2 or 4 bytes) into ``planes`` (its n\n"
"bytes per plane, one plane after the other): the inverse of join.");

static PyObject *split(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer out_view, in_view;
    int es, moved;
    if (!PyArg_ParseTuple(args, "w*y*ip", &out_view, &in_view, &es, &moved))
        return NULL;
    Py_ssize_t n = (es == 2 || es == 4) ? in_view.len / es : 0;
    if (!n || in_view.len != n * es || out_view.len != in_view.len) {
        PyBuffer_Release(&out_view);
        PyBuffer_Release(&in_view);
        PyErr_Format(PyExc_ValueError, "%zd bytes of %d-byte elements cannot split into %zd",
                     in_view.len, es, out_view.len);
        return NULL;
    }
    uint8_t *out = out_view.buf;
    const uint8_t *in = in_view.buf;
    Py_BEGIN_ALLOW_THREADS
    if (es == 2)
        split2(in, out, out + n, n, moved);
    else
        split4(in, out, out + n, out + 2 * n, out + 3 * n, n, moved);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out_view);
    PyBuffer_Release(&in_view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pack_doc,
"pack(codes, plane, k, base, escapes) -> int\n\n"
"The inverse of spread: ``k`` (2 or 4) codes per byte of ``codes``, lowest bits\n"
"first, each ``min(byte - base, escape)`` (mod 256; the escape is 2**(8 // k) - 1),\n"
"codes past the plane's end 0; the escaped bytes in order into ``escapes``, as many\n"
"as it holds. Returns how many bytes the plane escapes.");

#define PACK_CHUNK 64

static PyObject *pack(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer codes_view, plane_view, escapes_view;
    int k, base;
    if (!PyArg_ParseTuple(args, "w*y*iiw*", &codes_view, &plane_view, &k, &base, &escapes_view))
        return NULL;
    Py_ssize_t n = plane_view.len, count = codes_view.len, room = escapes_view.len;
    if ((k != 2 && k != 4) || base < 0 || base > 255 || count != (n + k - 1) / k) {
        PyBuffer_Release(&codes_view);
        PyBuffer_Release(&plane_view);
        PyBuffer_Release(&escapes_view);
        PyErr_Format(PyExc_ValueError, "%zd bytes do not pack %d to a byte into %zd", n, k,
                     count);
        return NULL;
    }
    uint8_t *codes = codes_view.buf, *escapes = escapes_view.buf;
    const uint8_t *plane = plane_view.buf;
    const uint8_t b = (uint8_t)base, escape = (uint8_t)(k == 2 ? 15 : 3);
    Py_ssize_t found = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Chunks of PACK_CHUNK bytes: offsets clamped to the escape (a loop that vectorizes),
     * and only a chunk that holds an escape is walked byte by byte for its bytes. */
    uint8_t offsets[PACK_CHUNK];
    for (Py_ssize_t at = 0; at < n; at += PACK_CHUNK) {
        Py_ssize_t size = n - at < PACK_CHUNK ? n - at : PACK_CHUNK;
        unsigned escaped = 0;
        for (Py_ssize_t i = 0; i < size; i++) {
            uint8_t o = (uint8_t)(plane[at + i] - b);
            escaped |= o >= escape;
            offsets[i] = o < escape ? o : escape;
        }
        if (escaped)
            for (Py_ssize_t i = 0; i < size; i++)
                if (offsets[i] == escape) {
                    if (found < room)
                        escapes[found] = plane[at + i];
                    found++;
                }
        for (Py_ssize_t i = size; i < PACK_CHUNK; i++) offsets[i] = 0;
        Py_ssize_t first = at / k, last = (at + size + k - 1) / k;
        if (k == 2)
            for (Py_ssize_t c = first; c < last; c++)
                codes[c] = (uint8_t)(offsets[2 * (c - first)] | offsets[2 * (c - first) + 1] << 4);
        else
            for (Py_ssize_t c = first; c < last; c++) {
                const uint8_t *o = offsets + 4 * (c - first);
                codes[c] = (uint8_t)(o[0] | o[1] << 2 | o[2] << 4 | o[3] << 6);
            }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&codes_view);
    PyBuffer_Release(&plane_view);
    PyBuffer_Release(&escapes_view);
    return PyLong_FromSsize_t(found);
}

/* JOINT blocks (extensions/_joint.py): every loop here runs over contiguous bytes with
 * no branch, so that it vectorizes; escapes are counted, then put in by a scan. */

/* One JOINT element from its joint byte c, its six bits and the base (shifted to the
 * exponent's place, base << 7): the two bytes side by side in a 16-bit lane, three
 * shifts and masks put them in place, so that the loops that call it vectorize eight
 * elements a vector at baseline x86-64 (SSE2). */
static inline uint16_t joint_word(uint8_t c, uint8_t six, uint16_t base7) {
    uint16_t v = (uint16_t)(six | c << 8);
    /* c << 5: the code lands on the exponent's bits 7-12, m on bits 5-6 (the six bits
     * shifted down below bit 5 are masked off, and base7 has none there to carry) */
    return (uint16_t)((((v >> 3) + base7) & 0x7FE0u) | (v & 0x1Fu) | ((v << 10) & 0x8000u));
}

static inline uint8_t six_of(uint16_t w) { return (uint8_t)(((w >> 10) & 0x20u) | (w & 0x1Fu)); }

#define ESCAPE_CHUNK 256

/* The joint plane and the six-bit rows of n words (escaped exponents coded 63);
 * returns whether an exponent escapes. */
WIDE static int joint_planes(uint8_t *restrict joint, uint8_t *restrict rest,
                             const uint8_t *restrict in, Py_ssize_t n, uint8_t base) {
    uint8_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t w = load16(in + 2 * i);
        uint8_t code = (uint8_t)((uint8_t)(w >> 7) - base);
        any |= code >= 63;
        joint[i] = (uint8_t)((code < 63 ? code : 63) << 2 | ((w >> 5) & 3));
    }
    Py_ssize_t q = (n + 3) / 4, fourth = n - 3 * q; /* words in the fourth quarter */
    Py_ssize_t start = fourth > 0 ? fourth : 0;
    if (fourth > 0) { /* then rows 0-2 are whole: one pass over the four quarters */
        uint8_t *r0 = rest, *r1 = rest + q, *r2 = rest + 2 * q;
        const uint8_t *w0 = in, *w1 = in + 2 * q, *w2 = in + 4 * q, *w3 = in + 6 * q;
        for (Py_ssize_t i = 0; i < fourth; i++) {
            uint8_t s3 = six_of(load16(w3 + 2 * i));
            r0[i] = (uint8_t)(six_of(load16(w0 + 2 * i)) | (uint8_t)(s3 << 6));
            r1[i] = (uint8_t)(six_of(load16(w1 + 2 * i)) | (uint8_t)((s3 >> 2) << 6));
            r2[i] = (uint8_t)(six_of(load16(w2 + 2 * i)) | (uint8_t)((s3 >> 4) << 6));
        }
    }
    for (Py_ssize_t k = 0; k < 3; k++) { /* past the fourth quarter: six bits, then 0 */
        uint8_t *row = rest + k * q;
        Py_ssize_t size = n - k * q < q ? (n - k * q > 0 ? n - k * q : 0) : q;
        for (Py_ssize_t i = start; i < size; i++) row[i] = six_of(load16(in + 2 * (k * q + i)));
        for (Py_ssize_t i = size > start ? size : start; i < q; i++) row[i] = 0;
    }
    return any;
}

/* The index of the first escape code (63, so >= 0xFC) of joint at or after i, or n.
 * The codes are tested a chunk of ESCAPE_CHUNK at a time: a chunk entered at its start
 * is passed by one vectorized test where it has none (most do), else searched. */
static inline Py_ssize_t next_escape(const uint8_t *restrict joint, Py_ssize_t i, Py_ssize_t n) {
    while (i < n) {
        Py_ssize_t end = (i / ESCAPE_CHUNK + 1) * ESCAPE_CHUNK;
        if (end > n)
            end = n;
        if (i % ESCAPE_CHUNK == 0) {
            uint8_t any = 0;
            for (Py_ssize_t k = i; k < end; k++) any |= joint[k] >= 0xFC;
            if (!any) {
                i = end;
                continue;
            }
        }
        for (; i < end; i++)
            if (joint[i] >= 0xFC)
                return i;
    }
    return n;
}

/* The exponents of the words joint codes as escapes, in order, into escapes (as many
 * as room holds); returns how many there are. */
static Py_ssize_t joint_escaped(uint8_t *restrict escapes, Py_ssize_t room,
                                const uint8_t *restrict joint, const uint8_t *restrict in,
                                Py_ssize_t n) {
    Py_ssize_t found = 0;
    for (Py_ssize_t i = next_escape(joint, 0, n); i < n; i = next_escape(joint, i + 1, n)) {
        if (found < room)
            escapes[found] = (uint8_t)(load16(in + 2 * i) >> 7);
        found++;
    }
    return found;
}

PyDoc_STRVAR(joint_split_doc,
"joint_split(joint, rest, words, base, escapes) -> int\n\n"
"The two planes of a bfloat16 JOINT block (extensions/_joint.py) from its n ``words``:\n"
"``joint`` (n bytes) gets ``code << 2 | m`` per word, ``code`` its exponent - base\n"
"(mod 256) where that is below 63, else 63 and the exponent goes to the next byte of\n"
"``escapes`` (as many as it holds), ``m`` the top two bits of its mantissa; ``rest``\n"
"(3 rows of q = ceil(n / 4) bytes) the sign above the low five mantissa bits, six bits\n"
"a word: byte i of row k holds word k*q + i's and, in its top two bits, bits 2k and\n"
"2k+1 of word 3*q + i's (0 past the end). Returns how many exponents escape.");

static PyObject *joint_split(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer v[4];
    int base;
    if (!PyArg_ParseTuple(args, "w*w*y*iw*", &v[0], &v[1], &v[2], &base, &v[3]))
        return NULL;
    Py_ssize_t n = v[2].len / 2, room = v[3].len, q = (n + 3) / 4;
    if (v[2].len != 2 * n || v[0].len != n || v[1].len != 3 * q || base < 0 || base > 255) {
        release_all(v, 4);
        PyErr_Format(PyExc_ValueError, "%zd bytes of words do not split into %zd and %zd",
                     v[2].len, v[0].len, v[1].len);
        return NULL;
    }
    uint8_t *joint = v[0].buf, *rest = v[1].buf, *escapes = v[3].buf;
    const uint8_t *in = v[2].buf;
    Py_ssize_t found;
    Py_BEGIN_ALLOW_THREADS
    found = joint_planes(joint, rest, in, n, (uint8_t)base)
                ? joint_escaped(escapes, room, joint, in, n)
                : 0;
    Py_END_ALLOW_THREADS
    release_all(v, 4);
    return PyLong_FromSsize_t(found);
}

PyDoc_STRVAR(joint_join_doc,
"joint_join(words, joint, rest, base, escapes) -> int\n\n"
"The inverse of joint_split into ``words`` (n 2-byte elements). Returns how many\n"
"escapes the codes hold, 0 to len(escapes) + 1: the caller refuses any count but\n"
"len(escapes), and words is then incomplete.");

/* The words of a JOINT block, escapes aside (their words get the code's exponent);
 * returns whether joint holds an escape code. */
WIDE static int joint_words(uint8_t *restrict out, const uint8_t *restrict joint,
                            const uint8_t *restrict rest, Py_ssize_t n, uint16_t base7) {
    uint8_t any = 0;
    Py_ssize_t q = (n + 3) / 4;
    for (Py_ssize_t k = 0; k < 3 && k * q < n; k++) {
        const uint8_t *row = rest + k * q, *c = joint + k * q;
        uint8_t *o = out + 2 * k * q;
        Py_ssize_t size = n - k * q < q ? n - k * q : q;
        for (Py_ssize_t i = 0; i < size; i++) {
            store16(o + 2 * i, joint_word(c[i], row[i], base7));
            any |= c[i] >= 0xFC;
        }
    }
    if (n > 3 * q) { /* a fourth quarter (pointers past the end are never formed) */
        const uint8_t *r0 = rest, *r1 = rest + q, *r2 = rest + 2 * q, *c = joint + 3 * q;
        uint8_t *o = out + 6 * q;
        for (Py_ssize_t i = 0; i < n - 3 * q; i++) {
            store16(o + 2 * i,
                    joint_word(c[i], (uint8_t)(r0[i] >> 6 | (r1[i] >> 6) << 2 | (r2[i] >> 6) << 4),
                               base7));
            any |= c[i] >= 0xFC;
        }
    }
    return any;
}

/* Each escaped word of out takes its exponent from escapes, in order, as far as the
 * stored ones go; returns how many escape codes joint holds, at most stored + 1. */
static Py_ssize_t joint_escapes(uint8_t *restrict out, const uint8_t *restrict joint,
                                Py_ssize_t n, const uint8_t *restrict escapes,
                                Py_ssize_t stored) {
    Py_ssize_t found = 0;
    for (Py_ssize_t i = next_escape(joint, 0, n); i < n && found <= stored;
         i = next_escape(joint, i + 1, n)) {
        if (found < stored) {
            uint8_t *o = out + 2 * i;
            store16(o, (uint16_t)((load16(o) & 0x807Fu) | (uint32_t)escapes[found] << 7));
        }
        found++;
    }
    return found > stored ? stored + 1 : found;
}

static PyObject *joint_join(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer v[4];
    int base;
    if (!PyArg_ParseTuple(args, "w*y*y*iy*", &v[0], &v[1], &v[2], &base, &v[3]))
        return NULL;
    Py_ssize_t n = v[0].len / 2, stored = v[3].len, q = (n + 3) / 4;
    if (v[0].len != 2 * n || v[1].len != n || v[2].len != 3 * q || base < 0 || base > 255) {
        release_all(v, 4);
        PyErr_Format(PyExc_ValueError, "planes of %zd and %zd bytes do not make %zd words",
                     v[1].len, v[2].len, n);
        return NULL;
    }
    uint8_t *out = v[0].buf;
    const uint8_t *joint = v[1].buf, *rest = v[2].buf, *escapes = v[3].buf;
    Py_ssize_t found;
    Py_BEGIN_ALLOW_THREADS
    found = joint_words(out, joint, rest, n, (uint16_t)(base << 7))
                ? joint_escapes(out, joint, n, escapes, stored)
                : 0;
    Py_END_ALLOW_THREADS
    release_all(v, 4);
    return PyLong_FromSsize_t(found);
}

PyDoc_STRVAR(memo_scan_doc,
"memo_scan(data, kinds) -> bool\n\n"
"Walk the opcodes of the pickle ``data`` up to its STOP, ``kinds`` giving each opcode\n"
"byte's argument (256 signed bytes: a fixed width 0-8, -1/-4/-8 a length prefix of that\n"
"many bytes, -100 one text line, -101 two, -128 no such opcode), and raise ValueError at\n"
"an invalid opcode, a LONG_BINPUT memo index beyond the opcodes before it, or an argument\n"
"that runs past the end of ``data``. Returns\n"
"True where the pickle holds a text PUT, whose index this does not parse (the caller\n"
"scans it in Python), else False.");

#define KIND_LINE (-100)
#define KIND_TWO_LINES (-101)
#define OP_STOP 0x2E        /* '.' */
#define OP_PUT 0x70         /* 'p' */
#define OP_LONG_BINPUT 0x72 /* 'r' */

/* 0: passed; 1: a text PUT (scan in Python); -1 with *at: an invalid opcode; -2 with
 * *at: a memo index out of range; -3 with *at: a text line without its end; -4 with
 * *at: an argument that runs past the end. Reads only inside data[0:end]. */
static int scan_memo(const uint8_t *data, Py_ssize_t end, const int8_t *kinds, Py_ssize_t *at) {
    Py_ssize_t pos = 0, count = 0;
    while (pos < end) {
        uint8_t op = data[pos];
        int kind = kinds[op];
        *at = pos;
        pos++;
        if (kind == -128)
            return -1;
        if (op == OP_STOP)
            return 0;
        if (kind >= 0) {
            if (op == OP_LONG_BINPUT) {
                uint64_t index = 0;
                Py_ssize_t avail = end - pos < 4 ? end - pos : 4;
                for (Py_ssize_t i = 0; i < avail; i++)
                    index |= (uint64_t)data[pos + i] << (8 * i);
                if (index > (uint64_t)count)
                    return -2;
            }
            if (kind > end - pos)
                return -4;
            pos += kind;
        } else if (kind == KIND_LINE || kind == KIND_TWO_LINES) {
            if (op == OP_PUT)
                return 1;
            for (int lines = kind == KIND_LINE ? 1 : 2; lines > 0; lines--) {
                const uint8_t *nl = memchr(data + pos, '\n', (size_t)(end - pos));
                if (nl == NULL)
                    return -3;
                pos = (nl - data) + 1;
            }
        } else {
            Py_ssize_t width = -kind;
            if (width > end - pos)
                return -4;
            uint64_t length = 0;
            for (Py_ssize_t i = 0; i < width; i++)
                length |= (uint64_t)data[pos + i] << (8 * i);
            pos += width;
            if (length > (uint64_t)(end - pos))
                return -4; /* a length past the end: the unpickler would reserve it first */
            pos += (Py_ssize_t)length;
        }
        count++;
    }
    return 0;
}

static PyObject *memo_scan(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data_view, kinds_view;
    if (!PyArg_ParseTuple(args, "y*y*", &data_view, &kinds_view))
        return NULL;
    if (kinds_view.len != 256) {
        PyBuffer_Release(&data_view);
        PyBuffer_Release(&kinds_view);
        PyErr_Format(PyExc_ValueError, "kinds holds %zd bytes, not 256", kinds_view.len);
        return NULL;
    }
    Py_ssize_t at = 0;
    int found;
    Py_BEGIN_ALLOW_THREADS
    found = scan_memo(data_view.buf, data_view.len, kinds_view.buf, &at);
    Py_END_ALLOW_THREADS
    int op = at < data_view.len ? ((const uint8_t *)data_view.buf)[at] : 0;
    PyBuffer_Release(&data_view);
    PyBuffer_Release(&kinds_view);
    if (found == -1)
        return PyErr_Format(PyExc_ValueError, "invalid pickle opcode 0x%x at byte %zd", op, at);
    if (found == -2)
        return PyErr_Format(PyExc_ValueError, "memo index out of range at byte %zd", at);
    if (found == -3)
        return PyErr_Format(PyExc_ValueError, "unterminated line at byte %zd", at);
    if (found == -4)
        return PyErr_Format(PyExc_ValueError, "the pickle ends inside the argument at byte %zd",
                            at);
    return PyBool_FromLong(found == 1);
}

static PyMethodDef methods[] = {
    {"join", join, METH_VARARGS, join_doc},
    {"spread", spread, METH_VARARGS, spread_doc},
    {"split", split, METH_VARARGS, split_doc},
    {"pack", pack, METH_VARARGS, pack_doc},
    {"joint_split", joint_split, METH_VARARGS, joint_split_doc},
    {"joint_join", joint_join, METH_VARARGS, joint_join_doc},
    {"memo_scan", memo_scan, METH_VARARGS, memo_scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "extensions._native",
    .m_doc = "Compiled loops of WeightCodec and the metadata scan (optional: numpy passes "
             "and a Python loop without them).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
