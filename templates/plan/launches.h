// The launch builder: a batch's launch requests (segments) laid out as kernel launches, each
// with its metadata and its schedule, in one page-locked buffer that plan() copies to the
// device in one go. The one implementation of launch assembly: every plan() path uses it
// (the interval planner's segments from the row pass, the planner-off path's one segment per
// request, CUDA-graph mode's fixed launch slots). Static C++, copied as it is into the
// planner module and every fa2/fa3 paged-prefill module (vg_plan_abi.h gives the layouts,
// variantgen/planning/planner.py reads the descriptor). Needs <flashinfer/attention/scheduler.cuh>
// and tvm_ffi_utils.h first.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "fa3_worklist.h"
#include "vg_plan_abi.h"

namespace vg_plan {
using namespace vg_abi;

inline int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
inline int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

// The options (PlanOption), read once and checked.
struct Options {
  int64_t page_size, num_sm, fa3_cta_tile_q, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, kv_dtype_bytes,
      fa2_min_tiles, max_window_launches, read_expect, graph_requests, graph_pages, graph_rows, window_count,
      pack,  // fa3 GQA packing: query heads per row group (1: off)
      max_pieces,  // key intervals a row's launch requests may read apart (0: every row one launch request)
      list_rows;   // rows at the segment table's end that hold page lists, not segments
  bool fa3, direct;
  int64_t windows[kFa3MaxWindowLaunches];
  bool graph() const { return graph_requests > 0; }
  // Launch slots laid out in CUDA-graph mode: custom, causal, none, then fa2's tail launch or
  // fa3's window launches.
  int64_t graph_slots() const { return fa3 ? 3 + kFa3MaxWindowLaunches : kFa2Launches; }
};

inline Options read_options(const int64_t* o, int64_t count) {
  VG_REQUIRE(count == kOptionFields) << "options: expected " << kOptionFields << " int64 values";
  Options c;
  c.page_size = o[kOptionPageSize];
  c.fa3 = o[kOptionFa3] != 0;
  c.direct = o[kOptionDirect] != 0;
  c.num_sm = o[kOptionNumSm];
  c.fa3_cta_tile_q = o[kOptionFa3CtaTileQ];
  c.num_qo_heads = o[kOptionNumQoHeads];
  c.num_kv_heads = o[kOptionNumKvHeads];
  c.head_dim_qk = o[kOptionHeadDimQk];
  c.head_dim_vo = o[kOptionHeadDimVo];
  c.kv_dtype_bytes = o[kOptionKvDtypeBytes];
  c.fa2_min_tiles = o[kOptionFa2MinTiles];
  c.max_window_launches = o[kOptionMaxWindowLaunches];
  c.read_expect = o[kOptionReadExpect];
  c.graph_requests = o[kOptionGraphRequests];
  c.graph_pages = o[kOptionGraphPages];
  c.graph_rows = o[kOptionGraphRows];
  c.window_count = o[kOptionWindowCount];
  c.pack = std::max<int64_t>(o[kOptionPackGqa], 1);
  c.max_pieces = o[kOptionMaxPieces];
  c.list_rows = o[kOptionListRows];
  for (int i = 0; i < kFa3MaxWindowLaunches; ++i) c.windows[i] = o[kOptionWindows + i];
  VG_REQUIRE(c.page_size > 0 && c.num_sm > 0 && c.fa3_cta_tile_q > 0) << "options: page_size, num_sm, cta tile";
  VG_REQUIRE(c.num_kv_heads > 0 && c.num_qo_heads > 0 && c.num_qo_heads % c.num_kv_heads == 0)
      << "options: heads " << c.num_qo_heads << "/" << c.num_kv_heads << " are not whole GQA groups";
  VG_REQUIRE(c.max_window_launches >= 0 && c.max_window_launches <= kFa3MaxWindowLaunches)
      << "options: max_window_launches=" << c.max_window_launches;
  VG_REQUIRE(!c.graph() || (c.graph_pages > 0 && c.graph_rows >= c.graph_requests))
      << "options: CUDA-graph capacity " << c.graph_requests << " requests, " << c.graph_pages << " pages, "
      << c.graph_rows << " rows";
  VG_REQUIRE(c.window_count >= -1 && c.window_count <= c.max_window_launches)
      << "options: window_count=" << c.window_count;
  VG_REQUIRE(c.pack == 1 || (c.fa3 && c.pack == c.num_qo_heads / c.num_kv_heads))
      << "options: pack_gqa=" << c.pack << " is neither off nor the fa3 GQA group "
      << c.num_qo_heads / c.num_kv_heads;
  // (partial outputs live outside CUDA-graph mode's static workspace: it takes no pieces yet.
  // With GQA packing a piece's launch requests write packed partial rows, as its in-place ones do.)
  VG_REQUIRE(c.max_pieces >= 0 && c.max_pieces <= kMaxPieces && (c.max_pieces == 0 || !c.graph()))
      << "options: max_pieces=" << c.max_pieces << " (at most " << kMaxPieces << "; 0 in CUDA-graph mode)";
  // (a page list's position table lives in its launch's metadata, sized per batch: not in the
  // fixed slots of CUDA-graph mode)
  VG_REQUIRE(c.list_rows >= 0 && (c.list_rows == 0 || !c.graph()))
      << "options: list_rows=" << c.list_rows << " (0 in CUDA-graph mode)";
  return c;
}

// plan()'s batch, from its host indices: int32 [3 batch + 2] = qo_indptr, paged_kv_indptr,
// paged_kv_last_page_len (checked by the wrapper; what a launch request may address is
// checked again here against them).
struct Batch {
  int64_t batch = 0, total_q = 0;
  std::vector<int64_t> q_start, kv_start, page_start;  // [batch + 1] each: rows, key rows, page-list entries
  int64_t qo_len(int64_t r) const { return q_start[r + 1] - q_start[r]; }
  int64_t kv_len(int64_t r) const { return kv_start[r + 1] - kv_start[r]; }
};

inline Batch read_batch(const int32_t* indices, int64_t count, int64_t page_size) {
  VG_REQUIRE(count >= 5 && (count - 2) % 3 == 0) << "indices: expected int32 [3 batch + 2] on the host";
  Batch b;
  b.batch = (count - 2) / 3;
  const int32_t* qo = indices;
  const int32_t* pages = qo + b.batch + 1;
  const int32_t* last = pages + b.batch + 1;
  b.q_start.assign(qo, qo + b.batch + 1);
  b.page_start.assign(pages, pages + b.batch + 1);
  b.kv_start.resize(b.batch + 1);
  b.kv_start[0] = 0;
  for (int64_t r = 0; r < b.batch; ++r) {
    const int64_t n = pages[r + 1] - pages[r];
    VG_REQUIRE(qo[r + 1] >= qo[r] && n >= 0 && (n == 0 || (last[r] >= 1 && last[r] <= page_size)))
        << "indices: request " << r << " is not a paged request (indptrs, last page length)";
    b.kv_start[r + 1] = b.kv_start[r] + (n > 0 ? (n - 1) * page_size + last[r] : 0);
  }
  b.total_q = b.q_start[b.batch];
  return b;
}

// One launch request, checked, with its page range.
struct Request {
  int64_t first_row, rows, request, cls, window, kv_begin, kv_end, q_pos, vis_lo, vis_hi;
  int64_t piece;  // -1: output in place; p: the rows' p-th key interval, into partial output p
  // keys [gap_from[j], gap_to[j]) of [kv_begin, kv_end) its page list skips (j < gaps; custom only)
  int64_t gaps, gap_from[kMaxKeyGaps], gap_to[kMaxKeyGaps];
  // or (custom, in place, no gaps) the request-local pages it reads, ascending: list_len of them at `list`
  const int64_t* list;
  int64_t list_len;
  int64_t page_first, pages, last_page_len;  // (pages: those it reads, its hull's less the gaps', or its list's)
};

// A request's page list from its segment: ascending request-local pages of its range
// [kv_begin, kv_end), at an entry of the list rows; a custom, in-place run without gaps only.
inline bool read_page_list(const int64_t* g, Request& r, const int64_t* lists, int64_t list_entries,
                           int64_t page_size) {
  const int64_t at = g[kSegPageListAt], n = g[kSegPageListLen];
  r.list = nullptr;
  r.list_len = 0;
  if (at == 0 && n == 0) return true;
  if (n < 1 || at < 0 || at > list_entries - n || r.cls != kCustom || r.piece != -1 || r.gaps != 0) return false;
  const int64_t first = r.kv_begin / page_size, end = ceil_div(r.kv_end, page_size);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t page = lists[at + j];
    if (page < first || page >= end || (j > 0 && page <= lists[at + j - 1])) return false;
  }
  r.list = lists + at;
  r.list_len = n;
  return true;
}

// A request's gaps from its segment: page-aligned, ascending, apart, with keys it reads on both
// sides; a custom run's only. Empty ones (0, 0) close the list. False where they are not so.
inline bool read_gaps(const int64_t* g, Request& r, int64_t page_size) {
  r.gaps = 0;
  int64_t after = r.kv_begin;  // keys before here are read or skipped already
  for (int j = 0; j < kMaxKeyGaps; ++j) {
    const int64_t from = g[kSegGapFrom1 + 2 * j], to = g[kSegGapTo1 + 2 * j];
    r.gap_from[j] = r.gap_to[j] = 0;
    if (from == 0 && to == 0) continue;
    if (r.gaps != j || r.cls != kCustom || from <= after || to <= from || to >= r.kv_end || from % page_size != 0 ||
        to % page_size != 0)
      return false;
    r.gap_from[j] = from;
    r.gap_to[j] = to;
    r.gaps = j + 1;
    after = to;
  }
  return true;
}

// The segments (kSegFields int64 each) as launch requests; each must address only its
// request's keys and pages. First, in row order, the segments of piece -1 (output in place)
// and 0 (a row's first key interval): every query row of the batch in exactly one. Then those
// of piece 1, 2 ... up to max_pieces - 1, each piece in row order, over rows that have the
// piece before it - so a row's pieces are 0 .. k-1 and run()'s merge reads exactly those.
inline std::vector<Request> read_segments(const int64_t* seg, int64_t nseg, const Batch& b, int64_t page_size,
                                          int64_t max_pieces = 0, const int64_t* lists = nullptr,
                                          int64_t list_entries = 0) {
  std::vector<Request> out(nseg);
  int64_t row = 0, piece_row = 0, last_piece = 0;
  std::vector<int8_t> pieces_of_row;  // rows' pieces so far (only when some segment has pieces)
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t* g = seg + i * kSegFields;
    Request& r = out[i];
    r.first_row = g[kSegFirstRow];
    r.rows = g[kSegEndRow] - r.first_row;
    r.request = g[kSegRequest];
    r.cls = g[kSegClass];
    r.window = g[kSegWindow];
    r.kv_begin = g[kSegKvBegin];
    r.kv_end = g[kSegKvEnd];
    r.q_pos = g[kSegQPos];
    r.vis_lo = g[kSegVisLo];
    r.vis_hi = g[kSegVisHi];
    r.piece = g[kSegPiece];
    const bool gaps_ok = read_gaps(g, r, page_size);
    const bool list_ok = read_page_list(g, r, lists, list_entries, page_size);
    VG_REQUIRE(r.piece >= -1 && r.piece < std::max<int64_t>(max_pieces, 0) + (r.piece == -1))
        << "segments: row " << i << " has piece " << r.piece << " (pieces on: " << max_pieces << ")";
    if (r.piece >= 1) {  // after the partition: rows of piece - 1, pieces in order, rows in order
      VG_REQUIRE(row == b.total_q && (r.piece > last_piece || (r.piece == last_piece && r.first_row >= piece_row)) &&
                 r.first_row >= 0 && g[kSegEndRow] > r.first_row && g[kSegEndRow] <= b.total_q)
          << "segments: row " << i << " (piece " << r.piece << ", rows " << r.first_row << "-" << g[kSegEndRow]
          << ") is not after the rows' partition, in piece and row order";
      if (pieces_of_row.empty()) pieces_of_row.assign(size_t(b.total_q), 0);  // (no row has piece 0)
      for (int64_t q = r.first_row; q < g[kSegEndRow]; ++q) {
        VG_REQUIRE(pieces_of_row[q] == r.piece)
            << "segments: row " << i << " (piece " << r.piece << ") covers row " << q << ", which has "
            << int(pieces_of_row[q]) << " pieces before it";
        pieces_of_row[q] = int8_t(r.piece + 1);
      }
      last_piece = r.piece;
      piece_row = g[kSegEndRow];
      row -= g[kSegEndRow] - r.first_row;  // (the partition's count below stays the batch's rows)
    } else if (r.piece == 0) {
      if (pieces_of_row.empty()) pieces_of_row.assign(size_t(b.total_q), 0);
      VG_REQUIRE(r.first_row >= 0 && g[kSegEndRow] <= b.total_q) << "segments: row " << i << " is past the batch";
      std::fill(pieces_of_row.begin() + r.first_row, pieces_of_row.begin() + g[kSegEndRow], int8_t(1));
    }
    const bool in_batch = r.request >= 0 && r.request < b.batch && r.cls >= kDense && r.cls <= kTail;
    VG_REQUIRE(in_batch && (r.first_row == row || r.piece >= 1) && r.rows >= 1 && b.q_start[r.request] <= r.first_row &&
                   r.first_row + r.rows <= b.q_start[r.request + 1])
        << "segments: row " << i << " (rows " << r.first_row << "-" << r.first_row + r.rows << ", request "
        << r.request << ", class " << r.cls << ") is not the next run of rows of one request of this batch";
    const int64_t kv_len = b.kv_len(r.request);
    VG_REQUIRE(r.q_pos == kv_len - b.qo_len(r.request) + (r.first_row - b.q_start[r.request]) &&
                   r.kv_begin >= 0 && r.kv_begin % page_size == 0 && r.kv_begin <= r.kv_end && r.kv_end <= kv_len &&
                   (r.cls == kWindow ? r.window >= 0 : r.window == -1) &&
                   // the kernel's diagonal (kv_end - rows) at or past each row's position
                   ((r.cls != kCausal && r.cls != kWindow) || r.kv_end >= r.q_pos + r.rows) &&
                   ((r.vis_lo == 0 && r.vis_hi == -1) ||
                    ((r.cls == kCustom || r.cls == kTail) && r.vis_lo >= r.kv_begin && r.vis_lo <= r.vis_hi &&
                     r.vis_hi < r.kv_end)))
        << "segments: row " << i << " (keys " << r.kv_begin << "-" << r.kv_end << ", q_pos " << r.q_pos
        << ", window " << r.window << ", visible " << r.vis_lo << "-" << r.vis_hi << ") does not fit request "
        << r.request << " (" << kv_len << " keys, page size " << page_size << ")";
    VG_REQUIRE(gaps_ok) << "segments: row " << i << " (class " << r.cls << ", keys " << r.kv_begin << "-" << r.kv_end
                        << ") skips gaps that are not page-aligned, ascending and inside its keys, or is not custom";
    VG_REQUIRE(list_ok) << "segments: row " << i << " (class " << r.cls << ", piece " << r.piece << ", keys "
                        << r.kv_begin << "-" << r.kv_end << ") has a page list that is not ascending pages of its "
                        << "keys inside the list rows, or is not a custom run in place without gaps";
    row += r.rows;
    const int64_t hull_pages = ceil_div(r.kv_end - r.kv_begin, page_size);
    r.pages = hull_pages;
    for (int j = 0; j < r.gaps; ++j) r.pages -= (r.gap_to[j] - r.gap_from[j]) / page_size;
    r.page_first = b.page_start[r.request] + r.kv_begin / page_size;
    r.last_page_len = hull_pages > 0 ? r.kv_end - r.kv_begin - (hull_pages - 1) * page_size : 0;
    if (r.list_len > 0) {  // (its last page is its range's last only where the list ends there)
      const int64_t last = r.list[r.list_len - 1];
      r.pages = r.list_len;
      r.last_page_len = last == ceil_div(r.kv_end, page_size) - 1 ? r.kv_end - last * page_size : page_size;
    }
  }
  VG_REQUIRE(row == b.total_q) << "segments: they cover " << row << " of the batch's " << b.total_q << " rows";
  return out;
}

// The planner-off plan: one custom launch request per request with rows, over all its keys.
inline std::vector<int64_t> direct_segments(const Batch& b) {
  std::vector<int64_t> seg;
  seg.reserve(kSegFields * b.batch);
  for (int64_t r = 0; r < b.batch; ++r) {
    if (b.qo_len(r) == 0) continue;
    const int64_t g[kSegFields] = {b.q_start[r], b.q_start[r + 1], r, kCustom, -1, 0, b.kv_len(r),
                                   b.kv_len(r) - b.qo_len(r), 0, -1, -1};  // (no keys known visible; in place; no gaps)
    static_assert(kSegFields == 13 + 2 * kMaxKeyGaps && kSegPageListAt == 11 + 2 * kMaxKeyGaps && kSegFirstRow == 0 && kSegEndRow == 1 && kSegRequest == 2 &&
                  kSegClass == 3 && kSegWindow == 4 && kSegKvBegin == 5 && kSegKvEnd == 6 && kSegQPos == 7 &&
                  kSegVisLo == 8 && kSegVisHi == 9 && kSegPiece == 10 && kSegGapFrom1 == 11, "segment layout");
    seg.insert(seg.end(), g, g + kSegFields);
  }
  return seg;
}

// ---------------------------------------------------------------------------------------
// FlashInfer's FA2 prefill work list for one launch whose KV is not split, in the layout its
// kernel reads (flashinfer::PrefillPlanInfo offsets into the int workspace): one CTA per
// (launch request, query tile), o_indptr = each launch request's own first row. FlashInfer's
// scheduler does the same plus split-KV bookkeeping that is O(query rows) on the host;
// without split-KV this is O(tiles). The tile size is FlashInfer's choice
// (FA2DetermineCtaTileQ), so the kernel dispatches as it would.
// graph_rows > 0 (CUDA-graph mode): sized for at most graph_rows rows over these launch
// requests, like FlashInfer's CUDA-graph scheduling - tile size from the longest request that
// could be, grid padded to the most tiles there could be, a valid-CTA mask - so that
// plan_info depends only on (graph_rows, launch requests, heads, head dims).
struct Fa2Shape {
  int64_t cta, tiles, padded, bytes;  // bytes from the (16-byte aligned) base
};

inline int64_t fa2_cta_tile_q(int64_t packed_len, const Options& c) {
  return flashinfer::FA2DetermineCtaTileQ(packed_len, uint32_t(c.head_dim_vo), uint32_t(c.head_dim_qk),
                                          uint32_t(c.kv_dtype_bytes));
}

// longest: size the tile for the longest launch request rather than the mean (the tail launch:
// each of its launch requests must be one query tile).
inline Fa2Shape fa2_shape(const int32_t* qo, int64_t n, const Options& c, int64_t graph_rows, bool longest = false) {
  VG_REQUIRE(n >= 1) << "schedule: no launch requests";
  const bool graph = graph_rows > 0;
  const int64_t rows = int64_t(qo[n] - qo[0]);
  VG_REQUIRE(!graph || (graph_rows >= rows && graph_rows >= n))
      << "graph_rows=" << graph_rows << " is below the rows (" << rows << ") or launch requests (" << n << ")";
  const int64_t group = c.num_qo_heads / c.num_kv_heads;
  int64_t packed_len = graph ? (graph_rows - n + 1) * group : rows * group / n;
  if (longest && !graph)
    for (int64_t b = 0; b < n; ++b) packed_len = std::max(packed_len, int64_t(qo[b + 1] - qo[b]) * group);
  Fa2Shape s;
  s.cta = fa2_cta_tile_q(packed_len, c);
  s.tiles = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t len = int64_t(qo[b + 1] - qo[b]) * group;
    VG_REQUIRE(len >= 0) << "qo_indptr must be non-decreasing";
    s.tiles += (len + s.cta - 1) / s.cta;
  }
  // sum of ceil(len_b / cta) <= ceil(sum len_b / cta) + n - 1
  s.padded = graph ? (graph_rows * group + s.cta - 1) / s.cta + n - 1 : s.tiles;
  VG_REQUIRE(s.tiles <= s.padded) << "more tiles than the CUDA-graph grid";
  const int64_t arrays = 3 * align16(4 * s.padded) + align16(4 * (n + 1));
  s.bytes = graph ? arrays + 2 * 16 + s.padded : arrays + 4;
  return s;
}

// Writes the work list of fa2_shape's `s` at byte `base` of `buffer`; returns its plan_info.
inline std::vector<int64_t> fa2_write(const Fa2Shape& s, char* buffer, int64_t base, const int32_t* qo,
                                      const int32_t* o, int64_t n, const Options& c, int64_t graph_rows) {
  VG_REQUIRE(base >= 0 && base % 16 == 0) << "base=" << base << ": expected a 16-byte aligned offset";
  const bool graph = graph_rows > 0;
  const int64_t group = c.num_qo_heads / c.num_kv_heads;
  const int64_t request_off = base;
  const int64_t q_tile_off = align16(request_off + 4 * s.padded);
  const int64_t kv_tile_off = align16(q_tile_off + 4 * s.padded);
  const int64_t o_off = align16(kv_tile_off + 4 * s.padded);
  const int64_t chunk_off = align16(o_off + 4 * (n + 1));
  const int64_t rows_off = graph ? align16(chunk_off + 4) : 0;
  const int64_t mask_off = graph ? align16(rows_off + 4) : 0;
  VG_REQUIRE((graph ? mask_off + s.padded : chunk_off + 4) - base == s.bytes) << "fa2 work list layout";
  int32_t* request = reinterpret_cast<int32_t*>(buffer + request_off);
  int32_t* q_tile = reinterpret_cast<int32_t*>(buffer + q_tile_off);
  int32_t* kv_tile = reinterpret_cast<int32_t*>(buffer + kv_tile_off);
  int64_t k = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t num_tiles = (int64_t(qo[b + 1] - qo[b]) * group + s.cta - 1) / s.cta;
    for (int64_t t = 0; t < num_tiles; ++t, ++k) {
      request[k] = int32_t(b);
      q_tile[k] = int32_t(t);
      kv_tile[k] = 0;
    }
  }
  std::fill(request + s.tiles, request + s.padded, 0);  // padding CTAs: masked off below
  std::fill(q_tile + s.tiles, q_tile + s.padded, 0);
  std::fill(kv_tile + s.tiles, kv_tile + s.padded, 0);
  std::copy(o, o + n + 1, reinterpret_cast<int32_t*>(buffer + o_off));
  *reinterpret_cast<int32_t*>(buffer + chunk_off) = INT32_MAX;  // read only with split-KV
  if (graph) {
    *reinterpret_cast<uint32_t*>(buffer + rows_off) = uint32_t(qo[n]);
    bool* valid = reinterpret_cast<bool*>(buffer + mask_off);
    std::fill(valid, valid + s.tiles, true);
    std::fill(valid + s.tiles, valid + s.padded, false);
  }
  std::vector<int64_t> info(kMaxPlanInfo, 0);
  info[kFa2InfoPaddedBatchSize] = s.padded;
  info[kFa2InfoTotalNumRows] = graph ? graph_rows : int64_t(qo[n]);
  info[kFa2InfoTotalNumRowsOffset] = rows_off;
  info[kFa2InfoCtaTileQ] = s.cta;
  info[kFa2InfoRequestIndicesOffset] = request_off;
  info[kFa2InfoQoTileIndicesOffset] = q_tile_off;
  info[kFa2InfoKvTileIndicesOffset] = kv_tile_off;
  info[kFa2InfoOIndptrOffset] = o_off;
  info[kFa2InfoKvChunkSizePtrOffset] = chunk_off;
  info[kFa2InfoBlockValidMaskOffset] = mask_off;
  info[kFa2InfoEnableCudaGraph] = graph;
  return info;
}

// ---------------------------------------------------------------------------------------
// The launches: launch requests grouped by mask mode - custom, causal, none; for fa2 the tail
// launch (causal, its own schedule), for fa3 (which takes its left window per launch, not per
// launch request) a causal launch per window width: the smallest max_window_launches widths
// of the batch, or in CUDA-graph mode the pinned ones; window rows of other widths run in the
// custom launch (exact: the mask).
struct LaunchSet {
  int32_t mode, window;
  std::vector<int32_t> members;
  bool tail = false;
  int32_t piece = -1;  // -1: writes in place; p: partial output p
  bool listed = false;  // custom launch requests over page lists (the listed variant: kListedRunCode)
};

// Whether a tail run is exact in fa2's tail launch: the kernel evaluates the mask from the
// diagonal tile of each query tile on, and the first tile's diagonal starts at or before the
// run's first query position, so the run must be one query tile (the tile the launch is
// scheduled with: sized for its longest launch request, or in CUDA-graph mode for the
// capacity) and its mask must be needed only from its first query position on. fa3's causal
// launch evaluates no mask: its tail runs go custom.
inline bool tail_fits(const Request& r, const Options& c) {
  if (c.fa3 || r.vis_lo > r.vis_hi || r.vis_lo > r.kv_begin || r.vis_hi + 1 < r.q_pos) return false;
  const int64_t group = c.num_qo_heads / c.num_kv_heads, packed = r.rows * group;
  const int64_t cta = c.graph() ? fa2_cta_tile_q((c.graph_rows - c.graph_requests + 1) * group, c)
                                : fa2_cta_tile_q(packed, c);
  return packed <= cta;
}

// GQA packing (fa3, requests of at most one query tile of packed rows): a launch request's
// rows run as rows x group packed rows of its key/value head, query head h = kv_head x group +
// packed row % group, its query row the packed row / group (the variant undoes it). The
// kernel's causal and window masks compare packed row indices, so none of them is exact
// there: a causal or window run becomes dense where its keys are all visible to its one row,
// else custom, with the keys all its rows see as known visible (the mask is evaluated only
// past them).
inline void pack_classes(std::vector<Request>& reqs) {
  for (Request& r : reqs) {
    if (r.cls != kCausal && r.cls != kWindow) continue;
    // rows see [lo_i, d + i], d the first row's diagonal (its q_pos, or past it for a band: the
    // keys end at the last row's): all of them [max(kv_begin, lo of the last row), d]
    const int64_t d = r.kv_end - r.rows, d_last = r.kv_end - 1;
    const int64_t lo = r.cls == kWindow ? std::max(r.kv_begin, d_last - r.window) : r.kv_begin;
    if (r.rows == 1 && lo == r.kv_begin) {
      r.cls = kDense;  // one row seeing every key of [kv_begin, kv_end)
    } else {
      r.cls = kCustom;
      r.vis_lo = lo <= d ? lo : 0;
      r.vis_hi = lo <= d ? d : -1;
    }
    r.window = -1;
  }
}

// Query-tile alignment. The kernels cut query tiles from each launch request's first row, so
// where the row pass ends a dense run one row short of a tile boundary and hands that row to
// the causal run that follows (the row sees exactly the dense run's keys, which is also the
// causal shape: mm_prefix's last span row), each run pays a part-filled tile. The row moves
// back into the dense run wherever that lowers the two runs' tile count: the same keys, the
// same pages, no mask evaluated, fewer tiles. Not with GQA packing (pack_classes makes both
// runs something else there).
inline int64_t query_tile(const Options& c, int64_t rows) {
  const int64_t group = c.num_qo_heads / c.num_kv_heads;
  return c.fa3 ? c.fa3_cta_tile_q : fa2_cta_tile_q(rows * group, c);
}

inline void align_query_tiles(std::vector<Request>& reqs, const Options& c) {
  if (c.pack > 1) return;
  const int64_t unit = c.fa3 ? 1 : c.num_qo_heads / c.num_kv_heads;  // kernel rows per query row
  size_t kept = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    Request& r = reqs[i];
    if (kept > 0 && r.cls == kCausal) {
      Request& d = reqs[kept - 1];
      const bool movable = d.cls == kDense && d.request == r.request && d.piece == r.piece &&
                           d.first_row + d.rows == r.first_row &&
                           d.kv_begin == r.kv_begin && d.kv_end == r.q_pos + 1 &&
                           r.kv_end == r.q_pos + r.rows;  // (not a band: its first row sees past q_pos)
      if (movable) {
        const int64_t t = query_tile(c, std::max(d.rows, r.rows));
        const auto tiles = [&](int64_t rows) { return ceil_div(rows * unit, t); };
        if (tiles(d.rows + 1) + tiles(r.rows - 1) < tiles(d.rows) + tiles(r.rows)) {
          d.rows += 1;
          r.first_row += 1;
          r.q_pos += 1;
          r.rows -= 1;
          if (r.rows == 0) continue;  // the causal run was that one row
        }
      }
    }
    reqs[kept++] = r;
  }
  reqs.resize(kept);
}

inline std::vector<int64_t> window_widths(const std::vector<Request>& reqs, const Options& c) {
  std::vector<int64_t> widths;
  if (!c.fa3) return widths;
  if (c.graph() && c.window_count >= 0) return std::vector<int64_t>(c.windows, c.windows + c.window_count);
  // The smallest widths, those of pieces first: a piece's window run must not go custom beyond
  // the kept widths, where the mask would see its rows' other pieces in its first page
  // (variantgen/pieces.py splits rows knowing this order).
  const auto smallest = [&](bool pieces) {
    std::vector<int64_t> w;
    for (const Request& r : reqs)
      if (r.cls == kWindow && (r.piece >= 0) == pieces) w.push_back(r.window);
    std::sort(w.begin(), w.end());
    w.erase(std::unique(w.begin(), w.end()), w.end());
    return w;
  };
  widths = smallest(true);
  if (int64_t(widths.size()) > c.max_window_launches) widths.resize(c.max_window_launches);
  for (const int64_t w : smallest(false))
    if (int64_t(widths.size()) < c.max_window_launches && std::find(widths.begin(), widths.end(), w) == widths.end())
      widths.push_back(w);
  std::sort(widths.begin(), widths.end());
  return widths;
}

inline std::vector<LaunchSet> group_launches(const std::vector<Request>& reqs, const Options& c) {
  const std::vector<int64_t> widths = window_widths(reqs, c);
  std::vector<LaunchSet> base = {LaunchSet{kModeCustom, -1, {}}, LaunchSet{kModeCausal, -1, {}},
                                 LaunchSet{kModeNone, -1, {}}};
  if (!c.fa3) base.push_back(LaunchSet{kModeCausal, -1, {}, true});
  for (const int64_t w : widths) base.push_back(LaunchSet{kModeCausal, int32_t(w), {}});
  // The same launches again per piece: a launch writes one output (o, or one partial output).
  // Pieces come after the in-place launches, so run() merges once all of them have run.
  // Custom launch requests over page lists (in place; never in CUDA-graph mode) get a launch of
  // their own after the in-place ones: the listed variant reads each key's position from the
  // list's table, a lookup per element the custom launch's variant is compiled without.
  int64_t pieces = 0;
  bool listed = false;
  for (const Request& r : reqs) {
    pieces = std::max(pieces, r.piece + 1);
    listed = listed || r.list_len > 0;
  }
  std::vector<LaunchSet> slots;
  std::vector<size_t> group_at;  // each piece's first slot (piece -1 first)
  for (int64_t p = -1; p < pieces; ++p) {
    group_at.push_back(slots.size());
    for (LaunchSet s : base) {
      s.piece = int32_t(p);
      slots.push_back(std::move(s));
    }
    if (p == -1 && listed) slots.push_back(LaunchSet{kModeCustom, -1, {}, false, -1, true});
  }
  for (int32_t i = 0; i < int32_t(reqs.size()); ++i) {
    const Request& r = reqs[i];
    size_t slot = r.cls == kCustom ? 0 : r.cls == kDense ? 2 : 1;
    if (r.cls == kTail) slot = tail_fits(r, c) ? 3 : 0;
    if (c.fa3 && r.cls == kWindow) {
      const auto at = std::find(widths.begin(), widths.end(), r.window);
      slot = at == widths.end() ? 0 : 3 + size_t(at - widths.begin());
    }
    if (r.list_len > 0) slot = base.size();  // (read_page_list: custom, in place)
    slots[group_at[size_t(r.piece + 1)] + slot].members.push_back(i);
  }
  if (c.graph()) return slots;  // fixed slots, empty or not (no pieces in CUDA-graph mode)
  std::vector<LaunchSet> out;
  for (LaunchSet& s : slots)
    if (!s.members.empty()) out.push_back(std::move(s));
  return out;
}

// A launch's int32 metadata (kArray* order) for n launch requests, in ints.
inline int64_t metadata_ints(int64_t n) { return (n + 1) + (n + 1) + n + kMetaColumns * n + (n + 1); }

// ---------------------------------------------------------------------------------------
// The whole plan into `host` (`capacity` bytes; the device workspace is as large): from
// offset 0 the page gather table, each launch's metadata, each launch's schedule, then room
// for the gathered page lists (written on the device). `desc` (kHeaderFields + kLaunchFields
// * kMaxLaunches int64) says where. Nothing is written to `host` unless the status is OK:
// kStatusWorkspace asks for a larger buffer; in CUDA-graph mode kStatusSlotRequests /
// kStatusSlotPages name the launch slot that does not fit the capacity. In CUDA-graph mode
// every offset depends on the capacity only: the launches keep their device addresses and
// plan_info from batch to batch.
inline void write_plan(std::vector<Request> reqs, const Batch& b, const Options& c, char* host,
                       int64_t capacity, int64_t* desc, int64_t desc_count) {
  VG_REQUIRE(desc_count == kHeaderFields + kLaunchFields * kMaxLaunches) << "desc: wrong size";
  std::fill(desc, desc + desc_count, 0);
  desc[kHeadSegments] = int64_t(reqs.size());
  const int64_t pack = c.pack;  // packed rows per query row (GQA packing; 1: off)
  align_query_tiles(reqs, c);
  if (pack > 1) pack_classes(reqs);
  const std::vector<LaunchSet> launches = group_launches(reqs, c);
  const bool graph = c.graph();
  const int64_t slots = graph ? c.graph_slots() : int64_t(launches.size());
  VG_REQUIRE(int64_t(launches.size()) <= kMaxLaunches) << "internal: too many launches";
  int64_t total_pages = 0;
  std::vector<int64_t> pages(launches.size(), 0);
  for (size_t l = 0; l < launches.size(); ++l) {
    for (const int32_t i : launches[l].members) pages[l] += reqs[i].pages;
    total_pages += pages[l];
  }
  if (graph) {  // the capacity, before anything is written
    for (size_t l = 0; l < launches.size(); ++l) {
      const int64_t n = int64_t(launches[l].members.size());
      const int status = n > c.graph_requests ? kStatusSlotRequests : pages[l] > c.graph_pages ? kStatusSlotPages : 0;
      if (status) {
        desc[kHeadStatus] = status;
        desc[kHeadAt] = int64_t(l);
        desc[kHeadNeed] = status == kStatusSlotRequests ? n : pages[l];
        return;
      }
    }
  }

  // Layout (sizes only): the table, each slot's metadata, each slot's schedule, the pages.
  int64_t table_ranges = 0;  // room for (first entry, shift, count) per non-empty launch request
  for (const Request& r : reqs) table_ranges += r.pages > 0 ? (r.list_len > 0 ? r.list_len : 1 + r.gaps) : 0;
  if (graph) table_ranges = std::max(table_ranges, slots * c.graph_requests);
  int64_t at = align16(12 * table_ranges);
  std::vector<int64_t> region(slots), slot_n(slots), kind(slots, kScheduleFlashInfer), sched_at(slots, 0);
  std::vector<Fa2Shape> fa2(slots);
  std::vector<int64_t> fa3_room(slots, 0);
  for (int64_t l = 0; l < slots; ++l) {
    slot_n[l] = graph ? c.graph_requests : int64_t(launches[l].members.size());
    region[l] = at;
    int64_t page_tables = 0;  // (after the metadata arrays: one int32 per page of each page list)
    if (l < int64_t(launches.size()))
      for (const int32_t i : launches[l].members) page_tables += reqs[i].list_len;
    at = align16(at + 4 * (metadata_ints(slot_n[l]) + page_tables));
  }
  std::vector<std::vector<int32_t>> plan_qo(slots);  // per slot, the rows packed (the schedules need them first)
  for (int64_t l = 0; l < slots; ++l) {
    std::vector<int32_t>& qo = plan_qo[l];
    qo.assign(slot_n[l] + 1, 0);
    const std::vector<int32_t> none;
    const std::vector<int32_t>& members = l < int64_t(launches.size()) ? launches[l].members : none;
    for (size_t k = 0; k < members.size(); ++k) qo[k + 1] = qo[k] + int32_t(reqs[members[k]].rows * pack);
    for (int64_t k = int64_t(members.size()); k < slot_n[l]; ++k) qo[k + 1] = qo[k];
    sched_at[l] = at;
    if (c.fa3) {
      kind[l] = kScheduleFa3;
      fa3_room[l] = graph ? ceil_div(c.graph_rows * pack, c.fa3_cta_tile_q) + c.graph_requests - 1
                          : fa3_tiles(qo.data(), slot_n[l], c.fa3_cta_tile_q);
      at = align16(at + fa3_work_list_bytes(fa3_room[l], c.num_sm));
    } else {
      // The tail launch keeps its own schedule, its tile sized for its longest launch request:
      // that is what makes it exact (tail_fits).
      const bool tail = l < int64_t(launches.size()) && launches[l].tail;
      fa2[l] = fa2_shape(qo.data(), slot_n[l], c, graph ? c.graph_rows : 0, tail);
      // Below fa2_min_tiles FlashInfer's scheduler may split KV - but not for a launch with a
      // kernel window: its fa2 kernel sizes a request's split-KV partial rows from the window it
      // runs with (ours, per launch request), its scheduler from the one it is planned with (one
      // per launch); those disagree, and the merge would read the wrong rows.
      bool windowed = false;
      for (const int32_t i : members) windowed = windowed || reqs[i].window >= 0;
      // (FlashInfer's scheduler sizes the tile for the mean launch request: the tail launch may
      // take it only where that is the same tile.)
      const bool same_tile = !tail || graph || fa2_shape(qo.data(), slot_n[l], c, 0).cta == fa2[l].cta;
      kind[l] = !graph && fa2[l].tiles < c.fa2_min_tiles && !windowed && same_tile ? kScheduleFlashInfer
                                                                                   : kScheduleFa2;
      if (kind[l] == kScheduleFa2) at = align16(at + fa2[l].bytes);
    }
  }
  const int64_t pages_offset = at;
  const int64_t extent = graph ? slots * c.graph_pages : total_pages;
  if (pages_offset + 4 * extent > capacity) {
    desc[kHeadStatus] = kStatusWorkspace;
    desc[kHeadNeed] = pages_offset + 4 * extent;
    return;
  }

  // Write: each launch's metadata and page ranges, then its schedule (in CUDA-graph mode the
  // launches are the slots in use: fa3 pins fewer window widths than it lays out).
  int32_t* table = reinterpret_cast<int32_t*>(host);
  std::vector<int32_t> first_entry, shift, count;
  first_entry.reserve(table_ranges);
  shift.reserve(table_ranges);
  count.reserve(table_ranges);
  int64_t stats[kTail + 1] = {0, 0, 0, 0, 0}, custom_rows = 0;
  int64_t page_at = 0;
  for (int64_t l = 0; l < int64_t(launches.size()); ++l) {
    const std::vector<int32_t>& members = launches[l].members;
    const int64_t n = slot_n[l], m = int64_t(members.size());
    int32_t* q_starts = reinterpret_cast<int32_t*>(host + region[l]);
    int32_t* kv_indptr = q_starts + n + 1;
    int32_t* last_page_len = kv_indptr + n + 1;
    int32_t* meta = last_page_len + n;
    int32_t* qo = meta + kMetaColumns * n;
    int64_t table_at = kMetaColumns * n + n + 1;  // the next page list's position table, from meta
    if (graph) page_at = l * c.graph_pages;
    bool packed = !graph;
    kv_indptr[0] = 0;
    for (int64_t k = 0; k < n; ++k) {
      int32_t* row = meta + kMetaColumns * k;
      if (k >= m) {  // an empty launch request (CUDA-graph padding): no rows, no keys, no window
        q_starts[k] = int32_t(b.total_q * pack);
        kv_indptr[k + 1] = kv_indptr[k];
        last_page_len[k] = 0;
        std::fill(row, row + kMetaColumns, 0);
        row[VG_META_Q_ROW_BASE] = int32_t(b.total_q);
        row[VG_META_KERNEL_WINDOW] = -1;
        row[VG_META_VIS_HI] = -1;
        for (int j = 0; j < kMaxKeyGaps; ++j) row[VG_META_GAP_AT_1 + 2 * j] = kNoGapAt;
        row[VG_META_PAGE_TABLE_AT] = -1;
        continue;
      }
      const Request& r = reqs[members[k]];
      const bool custom = launches[l].mode == kModeCustom;  // a tail run that does not fit runs custom
      ++stats[r.cls == kTail && custom ? kCustom : r.cls];
      if (custom) custom_rows += r.rows;
      q_starts[k] = int32_t(r.first_row * pack);  // (the kernel's rows: packed ones with GQA packing)
      kv_indptr[k + 1] = kv_indptr[k] + int32_t(r.pages);
      last_page_len[k] = int32_t(r.last_page_len);
      row[VG_META_Q_ROW_BASE] = int32_t(r.first_row);
      row[VG_META_Q_POS_BASE] = int32_t(r.q_pos);
      row[VG_META_KV_POS_BASE] = int32_t(r.kv_begin);
      row[VG_META_REQUEST] = int32_t(r.request);
      row[VG_META_KV_ROW_BASE] = int32_t(b.kv_start[r.request]);
      row[VG_META_REQ_QO_LEN] = int32_t(b.qo_len(r.request));
      row[VG_META_REQ_KV_LEN] = int32_t(b.kv_len(r.request));
      row[VG_META_KERNEL_WINDOW] = int32_t(r.window);
      row[VG_META_LAUNCH_QO_LEN] = int32_t(r.rows);
      // Keys the mask need not be evaluated on (the variant still applies the kernel window there,
      // which fa2's kernel leaves to it): a custom run's keys all its rows see; every key of a run
      // its launch's mode and window describe exactly (not a tail run: its diagonal tile needs
      // the mask).
      const bool exact = !custom && !launches[l].tail;
      const bool known = custom && r.vis_lo <= r.vis_hi;
      row[VG_META_VIS_LO] = known ? int32_t(r.vis_lo) : 0;
      row[VG_META_VIS_HI] = known ? int32_t(r.vis_hi) : exact ? kVisEveryKey : -1;
      // The gaps its page list skips, in list keys: gap j starts where the keys before it end.
      int64_t skipped = 0;
      for (int j = 0; j < kMaxKeyGaps; ++j) {
        const bool on = j < r.gaps;
        row[VG_META_GAP_AT_1 + 2 * j] = on ? int32_t(r.gap_from[j] - r.kv_begin - skipped) : kNoGapAt;
        row[VG_META_GAP_LEN_1 + 2 * j] = on ? int32_t(r.gap_to[j] - r.gap_from[j]) : 0;
        if (on) skipped += r.gap_to[j] - r.gap_from[j];
      }
      packed = packed && q_starts[k] == plan_qo[l][k];
      row[VG_META_PAGE_TABLE_AT] = r.list_len > 0 ? int32_t(table_at) : -1;
      row[VG_META_LIST_PAGE_SIZE] = int32_t(c.page_size);
      // its pages in the gathered list, each range merged with the last where contiguous: a
      // range per run of pages between gaps, or per page of its list (with the list's key
      // positions in its table)
      int64_t page = r.page_first, entry = page_at + kv_indptr[k];
      const auto add_range = [&](int64_t from_page, int64_t n_pages) {
        const int32_t out = int32_t(entry), d = int32_t(from_page) - out;
        if (!count.empty() && first_entry.back() + count.back() == out && shift.back() == d) {
          count.back() += int32_t(n_pages);
        } else {
          first_entry.push_back(out);
          shift.push_back(d);
          count.push_back(int32_t(n_pages));
        }
        entry += n_pages;
      };
      for (int64_t j = 0; j < r.list_len; ++j) {
        add_range(b.page_start[r.request] + r.list[j], 1);
        meta[table_at++] = int32_t(r.list[j] * c.page_size);
      }
      for (int j = 0; j <= r.gaps && r.pages > 0 && r.list_len == 0; ++j) {
        const int64_t end = j < r.gaps ? b.page_start[r.request] + r.gap_from[j] / c.page_size
                                       : r.page_first + ceil_div(r.kv_end - r.kv_begin, c.page_size);
        add_range(page, end - page);
        if (j < r.gaps) page = b.page_start[r.request] + r.gap_to[j] / c.page_size;
      }
    }
    q_starts[n] = int32_t(b.total_q * pack);
    std::copy(plan_qo[l].begin(), plan_qo[l].end(), qo);
    packed = packed && int64_t(qo[n]) == b.total_q * pack;

    std::vector<int64_t> info;
    if (kind[l] == kScheduleFa3) {
      std::vector<int32_t> keys(n);
      for (int64_t k = 0; k < n; ++k)
        keys[k] = kv_indptr[k + 1] > kv_indptr[k] ? (kv_indptr[k + 1] - kv_indptr[k] - 1) * int32_t(c.page_size) +
                                                        last_page_len[k] : 0;
      info = fa3_work_list(qo, kv_indptr, keys.data(), q_starts, n, launches[l].mode == kModeCausal,
                           c.fa3_cta_tile_q, c.num_sm, fa3_room[l], host, sched_at[l]);
      info.pop_back();
    } else if (kind[l] == kScheduleFa2) {
      info = fa2_write(fa2[l], host, sched_at[l], qo, q_starts, n, c, graph ? c.graph_rows : 0);
    }
    int64_t* d = desc + kHeaderFields + kLaunchFields * l;
    d[kLaunchMode] = launches[l].mode;
    d[kLaunchWindowLeft] = launches[l].window;
    d[kLaunchRequests] = m;
    d[kLaunchSlot] = n;
    d[kLaunchOffset] = region[l];
    d[kLaunchPacked] = packed;
    d[kLaunchSchedule] = kind[l];
    d[kLaunchRows] = qo[n] / pack;
    d[kLaunchPageAt] = page_at;
    d[kLaunchPages] = pages[l];
    d[kLaunchSlotPages] = graph ? c.graph_pages : d[kLaunchPages];
    d[kLaunchTail] = launches[l].tail;
    d[kLaunchPiece] = launches[l].piece;
    d[kLaunchListed] = launches[l].listed;
    d[kLaunchInfoLen] = int64_t(info.size());
    std::copy(info.begin(), info.end(), d + kLaunchInfo);
    if (!graph) page_at += pages[l];
  }
  const int64_t ranges = int64_t(count.size());
  std::copy(first_entry.begin(), first_entry.end(), table);
  std::copy(shift.begin(), shift.end(), table + ranges);
  std::copy(count.begin(), count.end(), table + 2 * ranges);
  desc[kHeadStatus] = kStatusOk;
  desc[kHeadCopyBytes] = pages_offset;
  desc[kHeadTableOffset] = 0;
  desc[kHeadRanges] = ranges;
  desc[kHeadPagesOffset] = pages_offset;
  desc[kHeadPagesExtent] = extent;
  desc[kHeadLaunches] = int64_t(launches.size());
  desc[kHeadDense] = stats[kDense];
  desc[kHeadCausal] = stats[kCausal];
  desc[kHeadWindow] = stats[kWindow];
  desc[kHeadCustom] = stats[kCustom];
  desc[kHeadCustomRows] = custom_rows;
  desc[kHeadTail] = stats[kTail];
}

}  // namespace vg_plan
