// Trains a two-layer network with snack::SparseLinear (90% sparse) in libtorch to imitate a random
// sparse teacher, on the GPU when there is one, then saves it and loads it into a fresh model (and
// shows that a corrupted checkpoint is refused), and serves it with its patterns kept for inference.
// Exits non-zero if the loss does not fall or a check fails.
#include <snack/torch/sparse_linear.h>
#include <torch/torch.h>

#include <cstdio>
#include <sstream>

struct StudentImpl : torch::nn::Module {
  StudentImpl()
      : hidden(register_module("hidden", snack::SparseLinear(snack::SparseLinearOptions(256, 512).density(0.1).seed(1)))),
        out(register_module("out", snack::SparseLinear(snack::SparseLinearOptions(512, 16).density(0.1).seed(2)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::relu(hidden(x))); }
  snack::SparseLinear hidden, out;
};
TORCH_MODULE(Student);

int main() {
  torch::manual_seed(0);
  const torch::Device device = torch::cuda::is_available() ? torch::kCUDA : torch::kCPU;
  snack::SparseLinear teacher(snack::SparseLinearOptions(256, 16).density(0.2).seed(7));
  teacher->to(device);
  Student student;
  student->to(device);
  torch::optim::AdamW optimizer(student->parameters(), torch::optim::AdamWOptions(3e-3));

  const torch::Tensor x = torch::randn({1024, 256}, device);
  const torch::Tensor target = teacher->forward(x).detach();
  float first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss = torch::mse_loss(student->forward(x), target);
    loss.backward();
    optimizer.step();
    last = loss.item<float>();
    if (step == 0) first = last;
    if (step % 50 == 0 || step == 199) std::printf("step %3d  loss %.5f\n", step, last);
  }
  std::printf("device %s, hidden layer: %lld of %d connections stored\n", device.str().c_str(),
              static_cast<long long>(student->hidden->nnz()), 256 * 512);
  if (!(last < 0.5f * first)) {
    std::fprintf(stderr, "loss did not fall enough: %.5f -> %.5f\n", first, last);
    return 1;
  }

  // A checkpoint round trip: a fresh model (another pattern) takes the trained one's slots and values.
  std::stringstream checkpoint;
  torch::save(student, checkpoint);
  Student resumed;
  resumed->to(device);
  torch::load(resumed, checkpoint);
  const float resumed_loss = torch::mse_loss(resumed->forward(x), target).item<float>();
  std::printf("reloaded: loss %.5f\n", resumed_loss);
  if (!torch::equal(resumed->hidden->to_dense(), student->hidden->to_dense())) {
    std::fprintf(stderr, "the reloaded weights differ\n");
    return 1;
  }
  // Serving: the patterns keep only what the forward reads; the outputs and the checkpoint stay the same.
  torch::Tensor served_before, served;
  const auto pattern_bytes = [&] { return student->hidden->pattern->nbytes() + student->out->pattern->nbytes(); };
  const int64_t bytes_before = pattern_bytes();
  {
    torch::NoGradGuard no_grad;
    served_before = student->forward(x);
    snack::for_inference(*student);
    served = student->forward(x);
  }
  std::printf("kept for inference: pattern bytes %lld -> %lld\n", static_cast<long long>(bytes_before),
              static_cast<long long>(pattern_bytes()));
  if (!torch::equal(served, served_before) || !(pattern_bytes() < bytes_before / 2)) {
    std::fprintf(stderr, "the model kept for inference computes otherwise, or holds as much\n");
    return 1;
  }
  try {
    student->forward(x);  // the values require gradients, which the dropped arrays would give
    std::fprintf(stderr, "a forward needing gradients ran on patterns kept for inference\n");
    return 1;
  } catch (const c10::Error& e) {
    std::printf("forward with gradients refused: %s\n", e.what_without_backtrace());
  }
  std::stringstream served_checkpoint;
  torch::save(student, served_checkpoint);
  Student served_twin;
  served_twin->to(device);
  torch::load(served_twin, served_checkpoint);
  snack::for_training(*student);
  if (!torch::equal(served_twin->hidden->to_dense(), student->hidden->to_dense()) ||
      !torch::equal(student->hidden->pattern->row_idx, resumed->hidden->pattern->row_idx)) {
    std::fprintf(stderr, "the checkpoint of the served model, or the rebuilt pattern, differs\n");
    return 1;
  }

  // A slot out of range in a checkpoint is an error, and the layer keeps its weights.
  snack::SparseLinear small(snack::SparseLinearOptions(8, 4).density(0.5));
  const torch::Tensor before = small->to_dense().clone();
  {
    snack::SparseLinear corrupt(snack::SparseLinearOptions(8, 4).density(0.5).seed(3));
    corrupt->pattern->col_idx[0] = 8;  // in_features is 8
    std::stringstream bad;
    torch::save(corrupt, bad);
    try {
      torch::load(small, bad);
      std::fprintf(stderr, "a corrupted checkpoint was loaded\n");
      return 1;
    } catch (const c10::Error& e) {
      std::printf("corrupted checkpoint refused: %s\n", e.what_without_backtrace());
    }
  }
  return torch::equal(small->to_dense(), before) ? 0 : 1;
}
