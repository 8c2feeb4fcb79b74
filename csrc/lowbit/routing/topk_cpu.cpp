// CPU reference of the row-wise top-k (topk.h): a partial sort of indices by
// (key descending, index ascending).
#include <algorithm>
#include <numeric>
#include <vector>

#include "lowbit/format/float_convert.h"
#include "lowbit/routing/topk.h"

namespace lowbit::topk {

int64_t topk_workspace_words(const TopkArgs& a) {
  const int64_t chunks = (a.cols + kChunk - 1) / kChunk;
  // per row: chunks * k candidates, each a key and an index
  return a.rows * chunks * a.k * 2;
}

void topk_cpu(const TopkArgs& a) {
  std::vector<uint32_t> key(a.cols);
  std::vector<int32_t> order(a.cols);
  const bool bf16 = a.input_dtype == DType::kBFloat16;
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t c = 0; c < a.cols; ++c) {
      const int64_t i = r * a.cols + c;
      const float x = bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(a.input)[i])
                           : static_cast<const float*>(a.input)[i];
      key[c] = order_key(x);
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + a.k, order.end(), [&](int32_t x, int32_t y) {
      return key[x] > key[y] || (key[x] == key[y] && x < y);
    });
    for (int32_t j = 0; j < a.k; ++j) {
      const int64_t src = r * a.cols + order[j];
      const int64_t dst = r * a.k + j;
      a.indices[dst] = order[j];
      if (bf16)
        static_cast<uint16_t*>(a.values)[dst] = static_cast<const uint16_t*>(a.input)[src];
      else
        static_cast<float*>(a.values)[dst] = static_cast<const float*>(a.input)[src];
    }
  }
}

}  // namespace lowbit::topk
